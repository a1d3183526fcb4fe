"""Protobuf in and out, with the SDK's own generated classes: the exact wire the SDK speaks.

In: ``ForwardBackwardRequest`` (optionally zstd-compressed). Out: ``ForwardBackwardOutput`` and
``SampleResponse`` (with prompt logprobs and top-k prompt logprobs when asked for), which SDK
0.38 accepts only as protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

_NP_OF = {
    pb.DTYPE_FLOAT32: np.float32,
    pb.DTYPE_INT64: np.int64,
    pb.DTYPE_INT32: np.int32,
}


@dataclass
class WireDatum:
    tokens: list[int]
    inputs: dict[str, np.ndarray]  # loss_fn_inputs, dense, flat


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    data: list[WireDatum] = field(default_factory=list)


def _tensor(msg: pb.Tensor) -> np.ndarray:
    dtype = _NP_OF.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"unsupported tensor dtype {msg.dtype}")
    shape = list(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        rows = len(crow) - 1
        cols = shape[1] if len(shape) > 1 else int(col.max(initial=-1)) + 1
        dense = np.zeros((rows, cols), dtype=dtype)
        for r in range(rows):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        return dense.reshape(-1)
    return np.frombuffer(msg.dense, dtype=dtype).copy()


def decode_fwdbwd(body: bytes, content_encoding: str | None = None, max_bytes: int = 2**30) -> FwdBwdRequest:
    """``ValueError`` (a client error) for a body that is not a valid request, or that
    decompresses to more than ``max_bytes``."""
    msg = pb.ForwardBackwardRequest()
    try:
        if content_encoding == "zstd":
            import zstandard

            body = zstandard.ZstdDecompressor().stream_reader(body).read(max_bytes + 1)
            if len(body) > max_bytes:
                raise ValueError(f"it decompresses to over {max_bytes} bytes")
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, zstandard's ZstdError: the client's bytes
        raise ValueError(f"the body is not a ForwardBackwardRequest ({type(e).__name__}: {e})") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for d in msg.data:
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise ValueError("the emulator serves text models only (no image or audio chunks)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        data.append(WireDatum(tokens, {name: _tensor(t) for name, t in d.loss_fn_inputs.items()}))
    return FwdBwdRequest(msg.model_id, msg.seq_id, msg.loss_fn, msg.forward_only, config, data)


def encode_fwdbwd_output(logprobs_D: list[list[float]], metrics: dict[str, float]) -> bytes:
    """One ArrayRecord with a ``logprobs`` field: a flat float32 buffer and byte offsets."""
    arrays = [np.asarray(lp, dtype=np.float32) for lp in logprobs_D]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    record = pb.ArrayRecord(type_tag="tinker:ArrayRecord", num_datums=len(arrays))
    field_ = record.fields["logprobs"]
    field_.data = b"".join(a.tobytes() for a in arrays)
    field_.offsets = offsets.tobytes()
    field_.dtype = pb.DTYPE_FLOAT32
    out = pb.ForwardBackwardOutput(loss_fn_output_type="tinker:ArrayRecord")
    out.loss_fn_outputs.append(record)
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


def encode_sample_response(
    sequences: list[tuple[list[int], list[float], str]],
    prompt_logprobs: np.ndarray | None = None,
    topk: tuple[np.ndarray, np.ndarray] | None = None,
) -> bytes:
    """``sequences``: (tokens, logprobs, stop_reason "stop" | "length") per sample; ``prompt_logprobs``:
    float32 [T], NaN where none was computed; ``topk``: the top-k prompt logprobs as (ids int32
    [T, k], logprobs float32 [T, k])."""
    out = pb.SampleResponse()
    for tokens, logprobs, stop in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if stop == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk is not None:
        ids, lps = topk
        out.topk_prompt_logprobs.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
        out.topk_prompt_logprobs.logprobs = np.ascontiguousarray(lps, dtype=np.float32).tobytes()
        out.topk_prompt_logprobs.length, out.topk_prompt_logprobs.k = ids.shape
    return out.SerializeToString()


def archive(files: dict[str, bytes]) -> bytes:
    """A checkpoint archive as the service serves it: a plain tar of the checkpoint's files at
    its root (for sampler weights ``adapter_config.json`` and ``adapter_model.safetensors``)."""
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()
