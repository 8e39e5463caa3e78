"""Batched acceptance kernels for speculative decoding (GitHub issue 8).

One public function per op. Each runs the Triton kernel when its tensors are on CUDA
(``backend="auto"``), or when ``backend="triton"`` is asked for explicitly (on CPU
that needs TRITON_INTERPRET=1, for tests); otherwise the vectorised torch reference in
``reference``, which agrees token for token with ``specmesh.acceptance``.
Randomness is always passed in (uniforms in [0, 1), float64 preferred), so every op is
a deterministic function of its inputs.

This package knows nothing about models, KV caches, sessions or services; it only
sees probabilities, drafted tokens and uniforms. Triton is imported lazily, so the
package imports (and the references run) on machines without it.

Modules: ``ops`` (the four public functions, re-exported here), ``reference`` (torch),
``triton_kernels`` / ``_triton_lib`` (Triton), ``_args`` (argument normalisation),
``bench`` and ``compile_check`` (``python -m specmesh.kernels.bench`` / ``.compile_check``).

Installed as ``specmesh.kernels`` (pyproject ``package-dir``). Reached as the bare name
``kernels`` (the repository root on ``sys.path``) this file loads nothing: Hugging Face
ships a package of that name, which transformers probes by importing ``kernels``.
"""

if __name__ == "specmesh.kernels":
    from .ops import chain_accept, residual_sample, tree_accept, tree_mask_and_positions

    __all__ = ["chain_accept", "tree_accept", "residual_sample", "tree_mask_and_positions"]
else:  # the bare name: an empty placeholder, so nothing runs twice under two names
    __path__ = []  # and none of its modules load under the bare name either

    def __getattr__(name):
        raise AttributeError(f"{name!r}: this folder is the package specmesh.kernels; import it by that name, "
                             f"not as {__name__!r}")
