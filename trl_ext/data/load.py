"""Prompt datasets from files and the hub (``--dataset`` / ``--eval_dataset``): load, validate, rename.

A source is a local file (``.jsonl`` / ``.json``: JSON lines or one array of objects; ``.csv``; ``.parquet``), a
directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, another local directory of data files,
or a hub id (``datasets.load_dataset(id, split=...)``). A file, a saved ``Dataset`` and a directory of files are one
split named "train" (``datasets``' own name for the split of ``data_files``). A split may be sliced with ``datasets``'
split syntax (``train[:90%]``, ``train[100:200]``, ``train+test``; ``datasets.ReadInstruction``), for every kind of
source.

The prompt column holds TRL's prompt formats (TRL docs, "Dataset formats"): plain text (standard) or a list of
``{"role", "content"}`` messages (conversational), and is renamed to TRL's ``prompt``. Every other column stays: TRL's
``GRPOTrainer._calculate_rewards`` passes each row's keys but ``prompt`` / ``completion`` / ``completion_ids`` to the
reward functions as keyword arguments (one list per key, aligned with the completions), next to its own ``prompts``,
``completions``, ``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric`` (and ``environments``): a column
named like one of these would collide (TypeError) or be dropped, and ``image`` / ``images`` are read by TRL as the
prompt's images; such columns are refused.

Every problem is a :class:`ConfigError` naming the flag, the source, the split and the column.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from trl_ext.registry import ConfigError

DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
"""Local data-file suffixes and the ``datasets`` packaged builder that reads them."""
DEFAULT_SPLIT = "train"
"""The split trained and evaluated on when ``--dataset_split`` / ``--eval_dataset_split`` is unset (a file's only
split)."""
DEFAULT_PROMPT_COLUMN = "prompt"
"""``--prompt_column`` when unset: TRL's own prompt column name."""
PROMPT = "prompt"
TRL_REWARD_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                   "environments")  # fmt: skip
"""Keyword arguments TRL 1.16's ``GRPOTrainer._calculate_rewards`` gives reward functions besides the columns."""
RESERVED_COLUMNS = {
    **{name: "TRL passes its own reward argument of that name" for name in TRL_REWARD_ARGS},
    "completion": "TRL drops it from the reward arguments", "completion_ids": "TRL drops it from the reward arguments",
    "image": "TRL reads it as the prompt's image (image prompts are not supported)",
    "images": "TRL reads it as the prompt's images (image prompts are not supported)",
}  # fmt: skip
SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
TEXT, CONVERSATIONAL = "text", "conversational"


@dataclass
class PromptData:
    """A validated prompt dataset: ``dataset`` has TRL's ``prompt`` column and the source's other columns."""

    dataset: object  # datasets.Dataset
    kind: str  # TEXT or CONVERSATIONAL
    source: str
    split: str

    @property
    def reward_columns(self) -> list[str]:
        """The columns TRL passes to reward functions (all but ``prompt``)."""
        return [c for c in self.dataset.column_names if c != PROMPT]

    def describe(self) -> str:
        cols = ", ".join(self.reward_columns) or "none"
        return f"{self.source} (split {self.split!r}): {len(self.dataset)} rows of {self.kind} prompts; columns " \
               f"passed to the rewards: {cols}"


# ------------------------------------------------------------------------------------------ sources
def is_local(source: str) -> bool:
    """Whether ``source`` names a local path (it exists, looks like a path, or has a data-file suffix); anything
    else is a hub id (``name`` or ``owner/name``)."""
    p = Path(source).expanduser()
    return (p.exists() or source.startswith(("/", ".", "~")) or p.suffix.lower() in DATA_FILE_BUILDERS
            or source.count("/") > 1 or "\\" in source)  # fmt: skip


def dataset_tag(source: str) -> str:
    """A short name of a source for run directory names: a file's stem, a directory's name, a hub id's last part."""
    p = PurePosixPath(source.replace("\\", "/").rstrip("/"))
    return p.stem if p.suffix.lower() in DATA_FILE_BUILDERS else p.name


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars and no error log lines from ``datasets`` (a failure is reported as one ConfigError line)."""
    import datasets

    bars = datasets.utils.logging.is_progress_bar_enabled()
    logger = logging.getLogger("datasets")
    level = logger.level
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _reason(e: BaseException) -> str:
    """The innermost cause of a loading error, on one line (``datasets`` wraps parser errors)."""
    while e.__cause__ is not None or (e.__context__ is not None and not str(e).strip()):
        e = e.__cause__ or e.__context__
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _slice(splits: dict, spec: str, where: str):
    """``spec`` (``datasets`` split syntax) applied to in-memory ``splits`` ({name: Dataset})."""
    import datasets

    if spec in splits:
        return splits[spec]
    try:
        parts = datasets.ReadInstruction.from_spec(spec).to_absolute({k: len(v) for k, v in splits.items()})
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"{where}: bad split {spec!r}: {_reason(e)} (splits: {', '.join(splits)})") from None
    pieces = [splits[p.splitname].select(range(p.from_, p.to)) for p in parts if p.to > p.from_]
    if not pieces:  # an empty slice: load_prompt_data reports it
        return splits[parts[0].splitname].select([])
    return pieces[0] if len(pieces) == 1 else datasets.concatenate_datasets(pieces)


def load_split(source: str, split: str, flag: str = "--dataset"):
    """One split of ``source`` as a ``datasets.Dataset``; ConfigError naming ``flag``, the source and the split."""
    import datasets

    where = f"{flag} {source}"
    local = is_local(source)
    path = Path(source).expanduser()
    if local and not path.exists():
        raise ConfigError(f"{where}: no such file or directory")
    if local and path.is_file():
        builder = DATA_FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ConfigError(f"{where}: unknown file type {path.suffix!r}; supported: "
                              f"{', '.join(DATA_FILE_BUILDERS)}, a save_to_disk directory, or a hub id")  # fmt: skip
        if path.stat().st_size == 0:
            raise ConfigError(f"{where}: the file is empty")
    try:
        with _quiet_datasets():
            if local and path.is_dir() and any((path / m).is_file() for m in SAVE_TO_DISK_MARKERS):
                saved = datasets.load_from_disk(str(path))
                splits = dict(saved) if isinstance(saved, datasets.DatasetDict) else {DEFAULT_SPLIT: saved}
                return _slice(splits, split, where)
            if local and path.is_file():
                return datasets.load_dataset(builder, data_files=str(path), split=split)
            return datasets.load_dataset(str(path) if local else source, split=split)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  (any loading failure is a configuration error, reported with its cause)
        what = "does not load" if local else "is not a local path, and the hub could not load it"
        reason = _reason(e)
        if "corresponds to no data" in reason:  # datasets' own refusal of an empty split or slice
            raise ConfigError(f"{where} (split {split!r}) has no rows") from None
        if "split" in reason.lower():
            what = f"has no split {split!r}"
        raise ConfigError(f"{where} {what}: {reason}") from None


# ------------------------------------------------------------------------------------------ the prompt column
def prompt_kind(dataset, column: str, where: str) -> str:
    """TEXT or CONVERSATIONAL from ``column``'s feature type and values (no null, no empty prompt, no empty message
    list, every message's role and content text); ConfigError naming the column and the first bad row."""
    import datasets
    import pyarrow.compute as pc

    feature = dataset.features[column]
    col = f"{where}: prompt column {column!r}"
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        values = dataset.with_format("arrow")[column]
        if values.null_count:
            raise ConfigError(f"{col}: row {_first(pc.is_null(values))} has no prompt (null)")
        empty = pc.equal(pc.utf8_length(values), 0)
        if pc.any(empty).as_py():
            raise ConfigError(f"{col}: row {_first(empty)} has an empty prompt")
        return TEXT
    inner = getattr(feature, "feature", None)
    if isinstance(feature, datasets.List) and isinstance(inner, dict) and {"role", "content"} <= set(inner):
        for key in ("role", "content"):
            if not (isinstance(inner[key], datasets.Value) and inner[key].dtype in ("string", "large_string")):
                raise ConfigError(f"{col}: messages' {key!r} must be text, got {inner[key]}")
        values = dataset.with_format("arrow")[column]
        lengths = pc.list_value_length(values)
        bad = pc.or_kleene(pc.is_null(lengths), pc.equal(lengths, 0))
        if pc.any(bad).as_py():
            raise ConfigError(f"{col}: row {_first(bad)} has no messages")
        flat, parents = pc.list_flatten(values), pc.list_parent_indices(values)
        for key in ("role", "content"):
            missing = pc.is_null(pc.struct_field(flat, key))
            if pc.any(missing).as_py():
                raise ConfigError(f"{col}: row {parents[_first(missing)].as_py()} has a message without {key!r}")
        return CONVERSATIONAL
    if isinstance(feature, datasets.List) and isinstance(inner, datasets.Json):  # messages whose keys differ by row
        for i, messages in enumerate(dataset[column]):
            if not messages:
                raise ConfigError(f"{col}: row {i} has no messages")
            for m in messages:
                for key in ("role", "content"):
                    if not isinstance(m, dict) or not isinstance(m.get(key), str):
                        raise ConfigError(f"{col}: row {i} has a message without text {key!r}: {m!r}")
        return CONVERSATIONAL
    raise ConfigError(f"{col} must hold text or conversational messages (a list of {{'role', 'content'}} dicts, "
                      f"TRL's formats), got {feature}")  # fmt: skip


def _first(mask) -> int:
    import pyarrow.compute as pc

    return pc.index(mask, True).as_py()


def load_prompt_data(source: str, split: str, prompt_column: str, flag: str = "--dataset",
                     max_rows: int | None = None) -> PromptData:  # fmt: skip
    """``split`` of ``source`` checked and ready for GRPOTrainer: not empty, ``prompt_column`` present and of a
    prompt type (`prompt_kind`), renamed to ``prompt``, no column TRL reserves (`RESERVED_COLUMNS`); the first
    ``max_rows`` rows (all when None; more than the split holds is an error)."""
    dataset = load_split(source, split, flag)
    where = f"{flag} {source} (split {split!r})"
    if len(dataset) == 0:
        raise ConfigError(f"{where} has no rows")
    columns = dataset.column_names
    if prompt_column not in columns:
        raise ConfigError(f"{where} has no column {prompt_column!r} (--prompt_column); columns: {', '.join(columns)}")
    if prompt_column != PROMPT and PROMPT in columns:
        raise ConfigError(f"{where}: --prompt_column {prompt_column!r} would be renamed to {PROMPT!r}, which the "
                          f"dataset already has; drop or rename one of them")  # fmt: skip
    for name in columns:
        if name in RESERVED_COLUMNS:
            raise ConfigError(f"{where}: column {name!r} cannot be passed to the rewards ({RESERVED_COLUMNS[name]}); "
                              "rename it")  # fmt: skip
    if max_rows is not None:
        if max_rows > len(dataset):
            raise ConfigError(f"--num_prompts {max_rows} exceeds the {len(dataset)} rows of {where}")
        dataset = dataset.select(range(max_rows))
    kind = prompt_kind(dataset, prompt_column, where)
    if prompt_column != PROMPT:
        dataset = dataset.rename_column(prompt_column, PROMPT)
    return PromptData(dataset, kind, source, split)


# ------------------------------------------------------------------------------------------ a run's data
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def has_chat_template(model_dir: Path) -> bool:
    """Whether the tokenizer saved in ``model_dir`` has a chat template (``tokenizer_config.json``'s
    ``chat_template`` or transformers' separate template files)."""
    import json

    config = model_dir / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("chat_template"):
        return True
    return any((model_dir / f).is_file() for f in CHAT_TEMPLATE_FILES)


def check_chat_prompts(data: PromptData, model: str, builtin_models, flag: str) -> None:
    """Conversational prompts need a chat template: the builtin models have none; a local model directory is
    checked from its files (a hub model's template is known once its tokenizer loads: TRL's apply_chat_template
    then fails by itself)."""
    if data.kind != CONVERSATIONAL:
        return
    where = f"{flag} {data.source} holds conversational prompts, which need a chat template"
    if model in builtin_models:
        raise ConfigError(f"{where}; --model {model}'s tokenizer has none (use text prompts, or an instruct model)")
    path = Path(model).expanduser()
    if path.is_dir() and not has_chat_template(path):
        raise ConfigError(f"{where}; {path}'s tokenizer has none (tokenizer_config.json chat_template, "
                          f"{', '.join(CHAT_TEMPLATE_FILES)})")  # fmt: skip


def eval_strategy_on(cfg) -> bool:
    strategy = getattr(cfg.eval_strategy, "value", cfg.eval_strategy)
    return strategy != "no"


def load_run_data(run, cfg, builtin_models=()) -> tuple[PromptData | None, PromptData | None]:
    """(training data, eval data) of a parsed run (RunArgs, ExtGRPOConfig), each None when not given; every
    contradiction or flag that would be ignored is a ConfigError (see docs/your-own.md)."""
    if cfg.env and (run.dataset or run.eval_dataset):
        raise ConfigError("--dataset / --eval_dataset and --env exclude each other: an environment makes its own "
                          "prompts (levels)")  # fmt: skip
    if run.eval_dataset and not eval_strategy_on(cfg):
        raise ConfigError(f"--eval_dataset {run.eval_dataset} would never be used: TRL evaluates only with "
                          "--eval_strategy steps (with --eval_steps N) or epoch")  # fmt: skip
    if eval_strategy_on(cfg) and not run.eval_dataset:
        raise ConfigError(f"--eval_strategy {getattr(cfg.eval_strategy, 'value', cfg.eval_strategy)} has nothing to "
                          "evaluate: pass --eval_dataset (prompts for TRL's eval loop)")  # fmt: skip
    train = eval_ = None
    if run.dataset:
        train = load_prompt_data(run.dataset, run.dataset_split, run.prompt_column, "--dataset", run.num_prompts)
        check_chat_prompts(train, run.model, builtin_models, "--dataset")
    if run.eval_dataset:
        eval_ = load_prompt_data(run.eval_dataset, run.eval_dataset_split, run.prompt_column, "--eval_dataset")
        check_chat_prompts(eval_, run.model, builtin_models, "--eval_dataset")
        if train is not None and (train.kind != eval_.kind or set(train.reward_columns) != set(eval_.reward_columns)):
            raise ConfigError(f"--eval_dataset {eval_.source} does not match --dataset {train.source}: "
                              f"{eval_.kind} prompts with columns {eval_.reward_columns} vs {train.kind} prompts with "
                              f"columns {train.reward_columns} (the same rewards score both)")  # fmt: skip
    if run.dataset and getattr(cfg, "eval_baseline", False):
        raise ConfigError("--eval_baseline samples held-out story prompts: not with --dataset")
    if run.dataset and getattr(cfg, "dual_lora", False) and cfg.eval_routing_steps:
        why = "the routing eval (--eval_routing_steps) samples held-out prompts"
        if eval_ is None:
            raise ConfigError(f"{why}: with --dataset it takes the first --eval_routing_prompts rows of "
                              "--eval_dataset; pass one, or --eval_routing_steps 0")  # fmt: skip
        if eval_.kind == CONVERSATIONAL:
            raise ConfigError(f"{why} as text: not conversational prompts (--eval_routing_steps 0)")
        from trl_ext.routing.args import routing_eval_count

        routing_eval_count(cfg, len(eval_.dataset), f"--eval_dataset {eval_.source}")  # warns or refuses here
    return train, eval_


def row_scorer(fn, data: PromptData, n: int):
    """A ``texts -> values`` scorer of completions sampled one per prompt of ``data``'s first ``n`` rows, in order
    (``texts[i]`` answers row ``i``; fewer texts: the first rows): a reward that reads more than texts
    (``needs_context()``, rewards/bound.py) gets ``prompts=`` and the rows' columns, as TRL passes them; any other
    reward is ``fn``."""
    needs = getattr(fn, "needs_context", None)
    if needs is None or not needs():
        return fn
    rows = data.dataset.select(range(n))
    context = {"prompts": list(rows[PROMPT]), **{c: list(rows[c]) for c in data.reward_columns}}

    def scorer(texts: list[str]) -> list:
        if len(texts) > n:
            raise ValueError(f"{len(texts)} completions for {n} prompts")
        return fn(texts, **{k: v[: len(texts)] for k, v in context.items()})

    return scorer


def eval_data_choice(dataset: str | None, split: str | None, column: str | None,
                     run: dict) -> tuple[str, str, str] | None:  # fmt: skip
    """eval_run.py's prompt dataset as (source, split, prompt column): its ``--dataset`` flags, else the run's
    ``--eval_dataset`` (``run``: run_config.yaml's RunArgs); None = the story prompts. ConfigError for a flag that
    would be ignored, a dataset run without held-out prompts, or the run's own training split."""
    if dataset is None and not run.get("eval_dataset"):
        if run.get("dataset"):
            raise ConfigError(f"the run trained on --dataset {run['dataset']} and had no --eval_dataset: pass "
                              "--dataset with held-out prompts (another file, or another split: --dataset_split)")
        for flag, value in (("--dataset_split", split), ("--prompt_column", column)):
            if value is not None:
                raise ConfigError(f"{flag} {value} would be ignored: it needs --dataset")
        return None
    column = column or run.get("prompt_column") or DEFAULT_PROMPT_COLUMN
    if dataset is None:
        return run["eval_dataset"], split or run.get("eval_dataset_split") or DEFAULT_SPLIT, column
    split = split or DEFAULT_SPLIT
    if dataset == run.get("dataset") and split == run.get("dataset_split"):
        raise ConfigError(f"--dataset {dataset} split {split!r} is the run's training data: pass a held-out split "
                          "(--dataset_split) or file")  # fmt: skip
    return dataset, split, column
