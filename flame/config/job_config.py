"""flame's extension of torchtitan's JobConfig.

torchtitan's ``ConfigManager._merge_configs`` merges these dataclasses into its own
(same-named sections merge field by field), so every torchtitan option keeps working and
flame adds the spellings flame users already type (``training.batch_size``,
``lr_scheduler.lr_min``, ``checkpoint.enable_checkpoint`` ...). Aliases are folded into the
torchtitan field they stand for by ``flame.config.manager.resolve_aliases``.
"""

from dataclasses import dataclass, field
from typing import Literal

from flame.lora.config import Lora
from flame.offload.config import Offload


@dataclass
class Job:
    print_args: bool = False
    """Print the fully resolved config at start-up (alias of ``job.print_config``)."""


@dataclass
class Model:
    name: str = "flame"
    """Name of the train spec; flame builds every model from ``model.config``."""

    config: str = ""
    """Path to a model JSON config (or a directory holding config.json), read with AutoConfig."""

    tokenizer_path: str | None = None
    """Path of a tokenizer loadable by ``AutoTokenizer.from_pretrained`` (local folder or cached hub id)."""

    module: list[str] = field(default_factory=list)
    """Python modules to import before the model is built (comma-separated), e.g. ``my_pkg.my_model``:
    a package of your own that registers its config/model with transformers' Auto classes (and its
    block class with ``flame.models.register_block_class``). Found on PYTHONPATH or the working directory."""

    vocab_multiple: int = 64
    """When the tokenizer has more tokens than the config's vocab_size, the vocab is raised to
    ``len(tokenizer)`` rounded up to this multiple (keeps the embedding/head matmuls aligned)."""

    init_from: str = ""
    """Start from the weights of a Hugging Face model: a local folder with safetensors weights
    (``model.safetensors`` or an index of shards; pickle ``.bin`` files are refused) or a hub id
    found in the local Hugging Face cache (never downloaded). Loaded before the first step on any
    parallelism and with offload; ignored (one log line) when the run resumes from its own
    checkpoint. Given on the command line without ``--model.config`` / ``--model.tokenizer_path``,
    the model config and (when the folder has one) the tokenizer are the folder's. Every tensor
    must match the model's name and shape, or the run stops naming it."""


@dataclass
class Optimizer:
    no_weight_decay: list[str] = field(default_factory=lambda: ["bias", "norm", "embed"])
    """Parameters whose name contains one of these substrings (or that are 1-D) get no weight
    decay. Pass an empty string to decay everything."""

    muon_lr: float | None = None
    """``optimizer.name Muon``: peak learning rate of the hidden 2-D matrices that Muon updates
    (the other parameters use ``optimizer.lr`` with AdamW); default: ``optimizer.lr``, which suits
    ``muon_adjust_lr match_rms_adamw``. The LR schedule scales both the same way."""

    muon_momentum: float = 0.95
    """``optimizer.name Muon``: momentum of Muon's (Nesterov) momentum buffer."""

    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """``optimizer.name Muon``: how the learning rate of an A x B matrix is scaled.
    ``match_rms_adamw``: by 0.2 * sqrt(max(A, B)), so that the update has the RMS of an AdamW
    update and AdamW's learning rate and weight decay carry over; ``original``: by
    sqrt(max(1, A / B)) (wants a larger ``muon_lr``, e.g. 0.02)."""


@dataclass
class LRScheduler:
    lr_min: float | None = None
    """Final learning rate as a fraction of the peak (alias of ``lr_scheduler.min_lr_factor``)."""


@dataclass
class Training:
    batch_size: int | None = None
    """Sequences per device per micro-batch (alias of ``training.local_batch_size``)."""

    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; the loss is normalized by the target tokens of the whole step."""

    context_len: int = 2048
    """Varlen only: documents longer than this are cut into pieces of at most this many tokens."""

    varlen: bool = False
    """Pack documents back to back and pass ``cu_seqlens`` so attention never crosses documents."""

    loss_chunk_tokens: int = -1
    """When > 0: the output projection and the cross-entropy run together, this many tokens at a
    time, so the [tokens, vocab] logits are never held whole (saves GPU memory with large
    vocabularies; same result). Needs a plain Linear output layer whose result the model returns
    unchanged, and no tensor parallelism. 0: ordinary logits + cross-entropy. -1 (default): flame
    chooses, and logs the choice: chunked when the float32 logits of one micro-batch (three times
    that without compile, which keeps three logit-sized tensors) would exceed an eighth of the GPU (or
    of offload.gpu_memory_gib; 1 GiB on CPU, never less than 1 GiB) and the model allows it, in chunks of about 512 MiB of logits (4096 tokens at a 32K
    vocabulary, 1024 at 128K); otherwise plain."""

    skip_nan_inf: bool = False
    """Skip the optimizer step when the gradient norm is NaN/Inf (the LR schedule does not advance)."""

    max_consecutive_skips: int = 10
    """With ``skip_nan_inf``: stop the run (exit 3, nothing saved) when more than this many optimizer
    steps in a row were skipped; 0: no limit. Without ``skip_nan_inf`` the first NaN/Inf stops it."""

    compile: bool = False
    """Compile every block with torch.compile (alias of ``compile.enable``)."""

    seed: int | None = None
    """Random seed for model init and data order (alias of ``debug.seed``)."""

    deterministic: bool = False
    """Use deterministic algorithms (alias of ``debug.deterministic``)."""

    dataset: str = "flame/assets/sample_corpus"
    """Comma-separated data sources: hub ids (from the local HF cache), local dirs, or a
    preprocessed token folder."""

    dataset_name: str | None = None
    """Comma-separated config names, one per source or one for all (empty entries allowed)."""

    dataset_split: str | None = None
    """Comma-separated splits, one per source or one for all (default ``train``)."""

    data_dir: str | None = None
    """Comma-separated ``data_dir`` arguments, one per source or one for all."""

    data_files: str | None = None
    """Comma-separated file globs, one per source or one for all (parquet, json/jsonl, txt, arrow)."""

    data_probs: list[float] | None = None
    """Sampling probabilities of the sources, comma-separated (normalized; must be positive)."""

    mix_by: Literal["documents", "tokens"] = "documents"
    """Whether ``data_probs`` are probabilities of drawing a document or shares of tokens."""

    text_column: str | None = None
    """Column holding the text; default: ``text`` or ``content``, whichever exists."""

    streaming: bool = False
    """Stream the sources instead of loading them map-style."""

    shuffle_buffer_size: int = 10000
    """Streaming only: size of the resumable shuffle buffer, in documents."""

    boundary_policy: Literal["auto", "bos", "eos", "bos_eos", "none"] = "auto"
    """Tokens added around every document: ``auto`` adds BOS when the tokenizer has one and
    always EOS, so tokenizers without BOS still separate documents; ``none`` adds nothing
    (for pre-tokenized ids that already carry them). Document boundaries for varlen never
    depend on these tokens."""

    mask_cross_document_labels: bool = False
    """Ignore (label -100) the prediction that crosses from one document into the next."""

    sft: bool = False
    """Supervised fine-tuning: the sources hold conversations (chat ``messages``, alpaca
    ``instruction``/``input``/``output`` or sharegpt ``conversations`` rows), rendered with the
    tokenizer's chat template (flame's bundled one when it has none); only the assistant tokens are
    trained and counted. Rows hold whole conversations (several per row with ``varlen``, one without,
    then padding); a longer one keeps its first ``seq_len`` (varlen: ``context_len``) tokens. See docs/data.md."""

    bad_document_policy: Literal["skip", "replace", "error"] = "skip"
    """A text row that is not valid UTF-8: ``skip`` it, ``replace`` the bad bytes with U+FFFD, or
    ``error`` (stop with one line naming the file and row). Skipped/replaced rows are counted per
    source in the loader's log line; the first one of each source is logged with its file and row."""

    num_workers: int = 0
    """DataLoader worker processes that tokenize and pack."""

    prefetch_factor: int | None = None
    """Batches each worker prepares ahead (only with num_workers > 0)."""

    pin_memory: bool = False
    """Pin the batches in host memory for faster copies to the GPU."""

    persistent_workers: bool = False
    """Keep the DataLoader workers alive between epochs."""

    data_parallel_replicate_degree: int | None = None
    """Alias of ``parallelism.data_parallel_replicate_degree``."""

    data_parallel_shard_degree: int | None = None
    """Alias of ``parallelism.data_parallel_shard_degree``."""

    tensor_parallel_degree: int | None = None
    """Alias of ``parallelism.tensor_parallel_degree``."""


@dataclass
class Checkpoint:
    enable_checkpoint: bool = False
    """Save checkpoints (alias of ``checkpoint.enable``)."""

    last_save_model_only: bool = False
    """Save only the model weights at the last step (then the run cannot be resumed from it)."""

    last_save_model_weights_only: bool = False
    """Alias of ``checkpoint.last_save_model_only``."""

    export_hf: bool = True
    """Write a Hugging Face folder (safetensors + config + tokenizer) of the final weights."""

    export_hf_every_checkpoint: bool = False
    """Also export a Hugging Face folder ``DUMP/hf_steps/step-N`` at every interval checkpoint (this blocks
    training while the weights are gathered and written)."""

    hf_upload_enabled: bool = False
    """Upload the final Hugging Face export (``DUMP/hf``) to the Hub in a background thread (off
    the training path); a failed upload is a warning, never an error."""

    hf_repo_base_name: str | None = None
    """Hub model repository (``name`` or ``org/name``) the final export is uploaded to with
    ``hf_upload_enabled``; created private when it does not exist. Needs a token (``HF_TOKEN``
    or ``huggingface-cli login``)."""

    hf_upload_timeout_seconds: float = 600.0
    """How long the trainer waits at exit for the background upload to finish."""

    on_damaged: Literal["fallback", "stop"] = "fallback"
    """What a resume (``load_step -1``) does when the newest complete checkpoint fails its size/checksum
    check: ``fallback`` logs one line naming the damaged file and loads the previous complete one;
    ``stop`` exits with that line (status 2). An explicitly requested ``load_step`` always stops."""

    allow_fresh_start: bool = False
    """Train from step 1 when the checkpoint folder holds step folders but none is usable (all
    incomplete or damaged); without it that is an error, never a silent restart."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["selective", "full", "memory_budget", "none"] = "none"
    """``none``; ``full`` recomputes every block; ``selective`` recomputes every N-th block
    (``selective_ac_option`` = N) or saves matmul outputs only (``op``)."""


@dataclass
class Validation:
    dataset: str | None = None
    """Validation sources, a comma list like ``training.dataset``; unset: the validation (or valid,
    val, test) split of the training sources, or their held-out share (``holdout_fraction``)."""

    interval: int | None = None
    """Validate every this many steps (alias of ``validation.freq``)."""

    steps: int = -1
    """Validation batches per evaluation; -1 (the default): one batch (flame never reads a whole
    validation set)."""

    local_batch_size: int | None = None
    """Sequences per device per validation batch; default: the training batch size."""

    seq_len: int | None = None
    """Validation sequence length; default: ``training.seq_len``."""

    holdout_fraction: float = 0.005
    """Without ``validation.dataset``, a training source with no validation split gives this share
    of its documents (at least one, chosen by a hash of their row) to validation, and training
    skips them. 0: such a source is an error (validation never reads training data)."""


@dataclass
class Probes:
    interval: int = 0
    """Run the research probes (attention sinks, sparsity, massive activations, kurtosis)
    on one held-out batch every this many steps; 0 disables them."""

    sink_threshold: float = 0.3
    """A head counts as a sink when its mean attention to the first token exceeds this."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    validation: Validation = field(default_factory=Validation)
    probes: Probes = field(default_factory=Probes)
    offload: Offload = field(default_factory=Offload)
    lora: Lora = field(default_factory=Lora)
