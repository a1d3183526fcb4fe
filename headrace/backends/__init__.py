"""Backends, picked by name: sim, torch, tinker (training + sampling) and vllm (sampling)."""
