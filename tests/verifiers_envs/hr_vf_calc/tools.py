"""The calculator: one MCP tool, served by verifiers in a process of its own."""

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two numbers."""
        return str(a + b)


if __name__ == "__main__":
    CalcToolset.run()
