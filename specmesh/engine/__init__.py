"""The model engine: the target's forward, its KV cache and the kernels it runs on.

What is here:

- ``llama``: ``LlamaEngine``, the Llama/Qwen2 forward written for serving (fp32, bf16,
  int8 or int4 weights; a slot KV cache; ``prefill`` / ``score`` / ``commit`` /
  ``rollback`` / ``score_batch``; the batch-invariant forward on CPU), with its
  ``Linear``, ``quantize_int4``, ``rms_norm`` and ``rope``.
- ``cudagraph``: ``GraphedEngine``, the same engine with CUDA-graph forwards (GPU).
- ``device``: which torch device to run on (``resolve_device``) and the counted
  device -> host reads (``host_list``, ``to_host``, ``counting_host_reads`` ...).
- The CPU kernels, small C libraries built once per machine by the cached JIT builder
  (``keylist_attention.compile_library``) from their sources in ``csrc/``
  (csrc/README.md): ``keylist_attention`` (attention by key list, the row norms, the
  builder itself), ``int4_matmul``, ``bf16_matmul``, ``layer_stack`` (the decoder
  layers in one C call); and ``rowops`` (exact ``argmax_rows`` / ``topk_rows``).

What is not here: sessions, tokenizers, sampling and acceptance (``specmesh.verifier``,
``specmesh.acceptance``), drafting (``specmesh.drafters``), loading a checkpoint
(``specmesh.models``), gRPC or serving. The package sits in the "numerics" layer
(docs/design.md, "Layering rules"): it imports only the leaves (types, trees) and
``specmesh.models``.

``from specmesh.engine import LlamaEngine`` (and the names below) is the public way in;
the other modules are imported by name (``from specmesh.engine import int4_matmul``,
``from specmesh.engine.device import resolve_device``). Importing the package loads the
engine and its kernel modules (reading their C sources, building nothing: a kernel is
built, or taken from the cache, at its first ``load()``), not ``cudagraph`` or
``layer_stack``.
"""

from .llama import (DTYPE_NAMES, INT4_HEADS, SCREEN_TOP, Linear, LlamaEngine, ScoreOutput, quantize_int4,
                    rms_norm, rope)

__all__ = ["DTYPE_NAMES", "INT4_HEADS", "SCREEN_TOP", "Linear", "LlamaEngine", "ScoreOutput", "quantize_int4",
           "rms_norm", "rope"]
