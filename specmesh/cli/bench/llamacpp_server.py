"""llama-cpp-python's OpenAI server (``python -m llama_cpp.server``) with llama.cpp's extra
weight buffers off: ``python -m specmesh.cli.bench.llamacpp_server <its flags>``.

On a CPU with AMX every forward of llama-cpp-python 0.3.36 built here died in
``ggml_backend_amx_mul_mat`` (``llamacpp_worker``'s docstring); the server died on its first
request. This runs the same server with ``use_extra_bufts = False``, so the benchmarks that
compare against it (``bench-tools``) run on such a machine too. Imports llama_cpp and the
standard library only.
"""

from __future__ import annotations

from .llamacpp_worker import without_extra_bufts


def main() -> None:
    without_extra_bufts()
    from llama_cpp.server.__main__ import main as serve

    serve()


if __name__ == "__main__":
    main()
