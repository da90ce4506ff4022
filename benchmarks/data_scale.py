"""Data prep and the training loader at three corpus sizes: does memory stay flat as the corpus grows?

Corpora: real text present on any machine, the installed source code and docs (every Python installation
found: the running interpreter's standard library and site-packages, ~/.pyenv, /usr/lib, /usr/local, plus
/usr/share, /usr/include and /opt), one file a JSONL document ({"text": ...}). Python sources and docs
(.py .pyi .md .rst .txt) come with the other installed sources (C/C++, Cython, JavaScript, HTML, shell,
Perl, Vim script, config files), because Python text alone falls short of 1 GB on a typical machine. Each
file's text counts once (exact copies are skipped) and each module path under a `lib/pythonX.Y/` counts
once (another version's copy of a module is a near duplicate that prep would drop, adding bytes but no
tokens); files over MAX_DOCUMENT_CHARS are cut at line ends into documents of at most that length, so prep's
data.max_chars keeps them. The files are ordered by a keyed hash of their text, so every corpus is a uniform
sample of the whole and each smaller corpus is a prefix of the larger ones: tokens grow about linearly with
the size. They are written once under --workdir and reused (rebuilt together when one is missing); a
rebuild after packages were installed or removed gives other corpora, so compare runs on the same ones.

Prep and training read each corpus as a weighted mixture of three sources (SOURCES: its documents dealt
into three JSONL files in turn, 5/3/2 of every 10, weighted 0.6/0.3/0.1), so a source packs and a training
batch samples as in a real mixture; the split files are written once beside the corpus.

Measured, each command a subprocess of the checkout this file is in, with the `tiny` preset and default
data params otherwise (near dedup on), but for input shards of SHARD_BYTES:

- prep: `llmflow prep` of each corpus with the tokenizer given (tokenizer.model_path), into an empty
  data.output_dir: tokens written (every split, BOS and EOS included), wall seconds of the whole command and
  tokens/s over them, and the peak resident memory of the whole process tree (the sum of RSS over the
  process and all its descendants, sampled every SAMPLE_SECONDS, the descendants listed every TREE_SECONDS;
  the peak of the sum). The command's wall time includes ~15-35 s that do not grow with the corpus
  (imports, Prefect's temporary server, MLflow), so the data-prep stage's own seconds are given too
  (`stage_s`: the `seconds` metric the stage records in MLflow, the time of `prepare_dataset` alone).
- tokenizer: the same `llmflow prep` of the smallest corpus, training the tokenizer there (printed on its
  own line). Its cost is that stage's seconds minus those of the prep with the trained tokenizer given.
- raw: `processor.encode(documents, num_threads=cores, return_type="numpy")` of every document of the
  largest corpus as it is in the JSONL source files prep reads (so both find them in the page cache), in batches of about RAW_BATCH_CHARS characters, with the same
  tokenizer on the same cores; only the encode calls are timed. Raw runs twice, before the prep runs and
  after them, and both are printed: its time moves 5-20% from one run to the next on a shared VM, more than
  the gap being measured, so the ratios use the mean of the two (never the faster one), which sees about
  the same loads as the preps between them. With --rounds N the largest corpus is prepared N times, each prep
  followed by another raw encoding; each prep is set against the mean of the raw encodings either side of it
  (`prep_over_raw_rounds`), and the round with the median ratio gives the figures below (its peak RSS the
  highest of the rounds'): one run then spans the machine's slower and faster spells. `prep_over_raw` counts
  the same tokens for both (raw's, those of the input text), so it is raw's mean seconds over the prep stage's,
  as benchmarks/data_prep.py defines it (`prep_over_raw_wall`: over the whole command's);
  `prep_written_over_raw` divides the tokens prep writes by the stage's seconds instead. On cores that other
  work shares, wall seconds measured minutes apart meet different loads, so CPU seconds are given too:
  `prep_over_raw_cpu` is raw's mean encoding CPU seconds over those of the whole prep command's process tree
  (`cpu_s`, its fixed costs included: imports, Prefect's server, MLflow, so it understates the stage's).
- train: `llmflow train` for --train-steps steps of the tiny model on the smallest and the largest prepared
  datasets (reused, never prepared again: the dataset directory must be untouched afterwards), peak RSS of
  the process tree, and mean seconds per step from --metrics-jsonl (every step logged; the first step,
  which compiles the graphs, left out). Four runs, smallest, largest, largest, smallest, so that a load
  drifting over them weighs on both alike; each size's figures are its highest peak RSS and its mean step
  time (`train_runs` lists every run).

Targets (issue 13): prep peak RSS at the largest size within 1.25x of the smallest, prep at least 0.8x raw at
the largest, train peak RSS within 1.1x and step time unchanged. The last line of stdout is one JSON object.

    python benchmarks/data_scale.py                                      # 25 MB, 250 MB, 1 GB, ~12 min here
    python benchmarks/data_scale.py --sizes 25,250 --workdir /tmp/scale  # a quicker run
    python benchmarks/data_scale.py --sizes 25,1000 --rounds 3           # the 1 GB ratio over three preps
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import sentencepiece as spm

REPO = Path(__file__).resolve().parents[1]
PYTHON_TEXT = (".py", ".pyi", ".md", ".rst", ".txt")
OTHER_SOURCES = (
    ".h", ".hpp", ".hh", ".c", ".cc", ".cpp", ".cu", ".cuh", ".pyx", ".pxd", ".js", ".html", ".css",
    ".sh", ".pl", ".pm", ".vim", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".cmake",
)
MAX_FILE_BYTES = 20_000_000  # larger "sources" are generated data tables
MIN_FILE_BYTES = 64  # prep's data.min_chars would drop anything shorter
MAX_DOCUMENT_CHARS = 100_000  # half of data.max_chars, so NFKC growth never pushes a piece past it
ORDER_KEY = b"llmflow-data-scale"
PYTHON_LIB = re.compile(r"/lib/python[0-9.]+/")
SAMPLE_SECONDS = 0.05
# The tree's members are listed this often, their RSS read every SAMPLE_SECONDS: listing them reads every
# process on the machine, which at every sample took 5.3% of a core (0.8% this way) beside the measured
# prep, a cost raw encoding, timed in this process with nothing sampled, never pays.
TREE_SECONDS = 1.0
RAW_BATCH_CHARS = 32_000_000
# Input shards of 8 MiB: every corpus, the 25 MB one included, is several shards on the same two worker
# processes, so the runs differ in the corpus only (at the default 64 MiB, 25 MB would be one shard, mapped
# inside the driver process). A worker's memory follows the shard size, never the corpus.
SHARD_BYTES = 8 << 20
# (name, weight, of every 10 documents of the corpus the ones it gets)
SOURCES = (("web", 0.6, range(0, 5)), ("code", 0.3, range(5, 8)), ("books", 0.1, range(8, 10)))
PREPARED = re.compile(r"^(prepared|reused) dataset (.+) \(manifest (.+)\)$", re.MULTILINE)


@dataclass(frozen=True)
class Corpus:
    megabytes: int
    path: Path
    bytes: int
    documents: int

    @property
    def label(self) -> str:
        return f"{self.megabytes}mb"


@dataclass(frozen=True)
class Measured:
    """One subprocess: its wall seconds, the CPU seconds of its process tree, the peak RSS of its process
    tree, and its stdout."""

    wall_s: float
    cpu_s: float
    peak_rss_bytes: int
    stdout: str


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/llmflow_data_scale"), help="corpora, datasets, logs")
    parser.add_argument("--sizes", default="25,250,1000", help="corpus sizes in MB (10^6 bytes of JSONL), e.g. 25,250")
    parser.add_argument("--train-steps", type=int, default=20, help="optimizer steps of each `llmflow train` run")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="preps of the largest corpus, each followed by a raw encoding; the ratio is the median over them",
    )
    args = parser.parse_args()
    sizes = sorted({int(size) for size in args.sizes.split(",")})
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    print(f"code: {REPO} ({_git_head()}), {cores} cores, work directory {workdir}", flush=True)

    corpora = ensure_corpora(workdir / "corpora", sizes)
    smallest, largest = corpora[0], corpora[-1]

    tokenizer, tokenizer_prep = prepare(workdir, smallest, None)
    raw_before = raw_encode(largest, tokenizer, cores)
    _print_raw("before the preps", largest, raw_before, cores)
    preps = {smallest.label: prepare(workdir, smallest, tokenizer)[1]}
    given_s = preps[smallest.label]["stage_s"]
    tokenizer_train_s = tokenizer_prep["stage_s"] - given_s
    print(f"tokenizer: trained on the {smallest.label} corpus in {tokenizer_train_s:.2f} s (the prep stage training "
          f"it took {tokenizer_prep['stage_s']:.2f} s, with it given {given_s:.2f} s)", flush=True)
    for corpus in corpora[1:]:
        preps[corpus.label] = prepare(workdir, corpus, tokenizer)[1]

    raws = [raw_before, raw_encode(largest, tokenizer, cores)]
    _print_raw("after the preps", largest, raws[-1], cores)
    rounds = [preps[largest.label]]
    for number in range(2, args.rounds + 1):
        rounds.append(prepare(workdir, largest, tokenizer)[1])
        raws.append(raw_encode(largest, tokenizer, cores))
        _print_raw(f"after prep round {number}", largest, raws[-1], cores)
    raw_tokens = raw_before[0]
    if any(raw[0] != raw_tokens for raw in raws):
        raise RuntimeError(f"raw encoding gave {[raw[0] for raw in raws]} tokens from one run to the next")
    # Each prep of the largest corpus against the mean of the raw encodings just before and after it.
    ratios = [statistics.mean([raws[i][1], raws[i + 1][1]]) / prep["stage_s"] for i, prep in enumerate(rounds)]
    middle = sorted(range(len(ratios)), key=ratios.__getitem__)[(len(ratios) - 1) // 2]  # the median round (lower)
    raw_s = statistics.mean([raws[middle][1], raws[middle + 1][1]])
    raw_cpu_s = statistics.mean([raws[middle][2], raws[middle + 1][2]])
    raw_tokens_per_s = raw_tokens / raw_s
    preps[largest.label] = {**rounds[middle], "peak_rss_mb": max(prep["peak_rss_mb"] for prep in rounds)}

    # Smallest, largest, largest, smallest: a load that drifts over the runs weighs on both sizes alike.
    train_runs = [
        (corpus.label, train(workdir, corpus, tokenizer, args.train_steps))
        for corpus in (smallest, largest, largest, smallest)
    ]
    trains = {
        corpus.label: _combined([figures for label, figures in train_runs if label == corpus.label])
        for corpus in (smallest, largest)
    }

    top, bottom = preps[largest.label], preps[smallest.label]
    prep_over_raw = raw_s / top["stage_s"]
    result = {
        "code": _git_head(),
        "cores": cores,
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "prep": preps,
        "tokenizer_train_s": round(tokenizer_train_s, 2),
        "tokenizer_prep": tokenizer_prep,
        "raw_tokens": raw_tokens,
        "raw_encode_s": round(raw_s, 2),
        "raw_encode_s_before_after": [round(raw[1], 2) for raw in raws],
        "raw_tokens_per_s": round(raw_tokens_per_s),
        "raw_encode_cpu_s": round(raw_cpu_s, 2),
        "prep_over_raw": round(prep_over_raw, 3),
        "prep_over_raw_rounds": [round(ratio, 3) for ratio in ratios],
        "prep_stage_s_rounds": [prep["stage_s"] for prep in rounds],
        "prep_over_raw_cpu": round(raw_cpu_s / top["cpu_s"], 3),
        "prep_over_raw_wall": round(raw_s / top["wall_s"], 3),
        "prep_written_over_raw": round(top["stage_tokens_per_s"] / raw_tokens_per_s, 3),
        "rss_ratio_largest_over_smallest": round(top["peak_rss_mb"] / bottom["peak_rss_mb"], 3),
        "train": trains,
        "train_runs": [{"corpus": label, **figures} for label, figures in train_runs],
        "train_rss_ratio": round(trains[largest.label]["peak_rss_mb"] / trains[smallest.label]["peak_rss_mb"], 3),
        "train_step_time_ratio": round(trains[largest.label]["step_s"] / trains[smallest.label]["step_s"], 3),
        "train_step_time_ratio_median": round(
            trains[largest.label]["step_s_median"] / trains[smallest.label]["step_s_median"], 3
        ),
    }
    result["targets_met"] = {
        "prep_rss_within_1.25x": result["rss_ratio_largest_over_smallest"] <= 1.25,
        "prep_at_least_0.8x_raw": prep_over_raw >= 0.8,
        "train_rss_within_1.1x": result["train_rss_ratio"] <= 1.1,
    }
    print(json.dumps(result))


# ------------------------------------------------------------------------------------------- corpora


def ensure_corpora(directory: Path, sizes: list[int]) -> list[Corpus]:
    """The corpora of these sizes, from the cache or written now (all of them together, so the smaller ones
    stay prefixes of the larger ones)."""
    directory.mkdir(parents=True, exist_ok=True)
    cached = [_cached_corpus(directory, size) for size in sizes]
    if all(cached):
        corpora = cached
    else:
        corpora = _write_corpora(directory, sizes)
    for corpus in corpora:
        megabytes = corpus.bytes / 1e6
        print(f"corpus {corpus.label}: {corpus.path}, {megabytes:,.1f} MB, {corpus.documents:,} documents", flush=True)
    if corpora[-1].bytes < sizes[-1] * 1e6 * 0.99:
        print(f"note: the installed text on this machine makes only {corpora[-1].bytes / 1e6:,.1f} MB of JSONL, "
              f"short of the {sizes[-1]} MB asked for; the largest corpus is all of it", flush=True)
    return corpora


def _cached_corpus(directory: Path, size: int) -> Corpus | None:
    info_path = directory / f"{size}mb.json"
    if not info_path.is_file():
        return None
    info = json.loads(info_path.read_text())
    path = directory / f"{size}mb.jsonl"
    if not path.is_file() or path.stat().st_size != info["bytes"]:
        return None
    return Corpus(size, path, info["bytes"], info["documents"])


def _write_corpora(directory: Path, sizes: list[int]) -> list[Corpus]:
    started = time.perf_counter()
    files, scanned = _distinct_files()
    targets = [size * 1_000_000 for size in sizes]
    partial = [directory / f"{size}mb.jsonl.partial" for size in sizes]
    written, documents = [0] * len(sizes), [0] * len(sizes)
    handles = [path.open("wb") for path in partial]
    try:
        for _, path in files:
            if written[-1] >= targets[-1]:
                break
            for piece in _documents(path):
                line = (json.dumps({"text": piece}, ensure_ascii=False) + "\n").encode()
                for index, handle in enumerate(handles):
                    if written[index] < targets[index]:
                        handle.write(line)
                        written[index] += len(line)
                        documents[index] += 1
    finally:
        for handle in handles:
            handle.close()
    corpora = []
    for size, path, size_bytes, count in zip(sizes, partial, written, documents, strict=True):
        final = directory / f"{size}mb.jsonl"
        path.rename(final)
        (directory / f"{size}mb.json").write_text(json.dumps({"bytes": size_bytes, "documents": count}) + "\n")
        corpora.append(Corpus(size, final, size_bytes, count))
    total_mb = sum(size for size, _ in scanned.values()) / 1e6
    print(f"corpora written in {time.perf_counter() - started:.0f} s from {len(files):,} distinct files "
          f"({total_mb:,.1f} MB of text on this machine):", flush=True)
    for suffix, (size, count) in sorted(scanned.items(), key=lambda item: -item[1][0])[:12]:
        print(f"  {suffix}: {size / 1e6:,.1f} MB in {count:,} files", flush=True)
    return corpora


def _roots() -> list[Path]:
    """Where installed text lives: this interpreter first (its copy of a module wins), then every other."""
    roots = [Path(sys.prefix), Path(sys.base_prefix), Path.home() / ".pyenv"]
    roots += [Path(path) for path in ("/usr/lib", "/usr/local", "/usr/share", "/usr/include", "/opt")]
    return [root for root in roots if root.is_dir()]


def _distinct_files() -> tuple[list[tuple[bytes, Path]], dict[str, tuple[int, int]]]:
    """(order key, path) of every distinct text file, in key order; and MB and files per suffix."""
    seen_text: set[bytes] = set()
    seen_modules: set[str] = set()
    seen_directories: set[str] = set()
    files: list[tuple[bytes, Path]] = []
    scanned: dict[str, tuple[int, int]] = {}
    suffixes = PYTHON_TEXT + OTHER_SOURCES
    for root in _roots():
        for directory, subdirectories, names in os.walk(root):
            real = os.path.realpath(directory)
            if real in seen_directories:
                subdirectories.clear()
                continue
            seen_directories.add(real)
            subdirectories.sort()
            for name in sorted(names):
                suffix = os.path.splitext(name)[1].lower()
                if suffix not in suffixes:
                    continue
                path = Path(directory, name)
                module = _module_path(str(path))
                if module is not None and module in seen_modules:
                    continue
                data = _read_text_file(path)
                if data is None:
                    continue
                digest = hashlib.blake2b(data, digest_size=16, key=ORDER_KEY).digest()
                if digest in seen_text:
                    continue
                seen_text.add(digest)
                if module is not None:
                    seen_modules.add(module)
                files.append((digest, path))
                size, count = scanned.get(suffix, (0, 0))
                scanned[suffix] = (size + len(data), count + 1)
    files.sort()
    return files, scanned


def _module_path(path: str) -> str | None:
    """`site-packages/numpy/linalg.py` for any Python installation's copy of it; None outside a lib/pythonX.Y."""
    match = PYTHON_LIB.search(path)
    if match is None:
        return None
    return path[match.end():].replace("dist-packages/", "site-packages/")


def _read_text_file(path: Path) -> bytes | None:
    """The file's bytes when it is a regular UTF-8 text file of a useful size, else None."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        size = path.stat().st_size
        if not MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
            return None
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if b"\0" in data else data


def _documents(path: Path) -> list[str]:
    """The file's text as documents of at most MAX_DOCUMENT_CHARS characters, cut at line ends."""
    data = _read_text_file(path)
    if data is None:  # changed since the scan
        return []
    text = data.decode("utf-8")
    if len(text) <= MAX_DOCUMENT_CHARS:
        return [text]
    pieces, current, length = [], [], 0
    for line in text.splitlines(keepends=True):
        while len(line) > MAX_DOCUMENT_CHARS:  # one enormous line: cut it where it must be cut
            pieces.append(line[:MAX_DOCUMENT_CHARS])
            line = line[MAX_DOCUMENT_CHARS:]
        if length + len(line) > MAX_DOCUMENT_CHARS:
            pieces.append("".join(current))
            current, length = [], 0
        current.append(line)
        length += len(line)
    if current:
        pieces.append("".join(current))
    return [piece for piece in pieces if piece]


# ---------------------------------------------------------------------------------- llmflow commands


def _source_files(corpus: Corpus) -> list[Path]:
    """The corpus's documents dealt into one JSONL file per source of SOURCES, streamed, written once (named by
    the corpus's size in bytes, so a rewritten corpus gets new ones)."""
    paths = [corpus.path.with_name(f"{corpus.label}-{corpus.bytes}-{name}.jsonl") for name, _, _ in SOURCES]
    if all(path.is_file() for path in paths):
        return paths
    owner = {slot: index for index, (_, _, slots) in enumerate(SOURCES) for slot in slots}
    partial = [path.with_name(path.name + ".partial") for path in paths]
    handles = [path.open("wb") for path in partial]
    try:
        with corpus.path.open("rb") as lines:
            for number, line in enumerate(lines):
                handles[owner[number % 10]].write(line)
    finally:
        for handle in handles:
            handle.close()
    for path, final in zip(partial, paths):
        path.rename(final)
    return paths


def _overrides(workdir: Path, corpus: Corpus, output_dir: Path, tokenizer: Path | None) -> list[str]:
    sources = [
        {"kind": "jsonl", "paths": [str(path)], "name": name, "weight": weight}
        for path, (name, weight, _) in zip(_source_files(corpus), SOURCES)
    ]
    values = {
        "data.sources": json.dumps(sources),
        "data.output_dir": str(output_dir),
        "tracking.uri": _tracking_uri(workdir),
        "train.output_dir": str(workdir / "train"),
        "data.shard_bytes": str(SHARD_BYTES),
    }
    if tokenizer is not None:
        values["tokenizer.model_path"] = str(tokenizer)
    return [argument for key, value in values.items() for argument in ("--set", f"{key}={value}")]


def prepare(workdir: Path, corpus: Corpus, tokenizer: Path | None) -> tuple[Path, dict]:
    """`llmflow prep` of the corpus from scratch, with the tokenizer given or (None) training one: the
    dataset's tokenizer (copied to workdir/tokenizer.model when trained here) and the run's figures."""
    name = corpus.label if tokenizer is not None else f"tokenizer-{corpus.label}"
    output_dir = workdir / "prep" / name
    shutil.rmtree(output_dir, ignore_errors=True)
    measured = _llmflow(workdir, "prep", _overrides(workdir, corpus, output_dir, tokenizer), f"prep-{name}")
    dataset_dir, manifest = _prepared(measured.stdout)
    if tokenizer is None:
        tokenizer = workdir / "tokenizer.model"
        shutil.copyfile(dataset_dir / "tokenizer.model", tokenizer)
    tokens = sum(split["tokens"] for split in manifest["splits"].values())
    stage_s = _stage_seconds(workdir, dataset_dir)
    figures = {
        "corpus_mb": round(corpus.bytes / 1e6, 1),
        "documents": corpus.documents,
        "tokens": tokens,
        "wall_s": round(measured.wall_s, 2),
        "tokens_per_s": round(tokens / measured.wall_s),
        "cpu_s": round(measured.cpu_s, 2),
        "peak_rss_mb": round(measured.peak_rss_bytes / 1e6, 1),
        "stage_s": round(stage_s, 2),
        "stage_tokens_per_s": round(tokens / stage_s),
    }
    print(f"prep {name}: {tokens:,} tokens in {measured.wall_s:.1f} s ({figures['tokens_per_s']:,} tokens/s; the stage "
          f"alone {stage_s:.1f} s, {figures['stage_tokens_per_s']:,} tokens/s), "
          f"peak RSS {figures['peak_rss_mb']:,.0f} MB", flush=True)
    return tokenizer, figures


def _stage_seconds(workdir: Path, dataset_dir: Path) -> float:
    """The seconds the data-prep stage recorded in MLflow for the run that wrote this dataset (stage runs are
    named `<flow run>/data_prep`)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(_tracking_uri(workdir))
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    runs = client.search_runs(
        experiments, f"attributes.run_name LIKE '%data_prep' and tags.`llmflow.dataset_dir` = '{dataset_dir}'",
        order_by=["attributes.start_time DESC"], max_results=1,
    )
    if not runs or "seconds" not in runs[0].data.metrics:
        raise RuntimeError(f"no data_prep run with a `seconds` metric for {dataset_dir} in {_tracking_uri(workdir)}")
    return runs[0].data.metrics["seconds"]


def _tracking_uri(workdir: Path) -> str:
    return f"sqlite:///{workdir}/mlflow.db"


def train(workdir: Path, corpus: Corpus, tokenizer: Path, steps: int) -> dict:
    """`llmflow train` on the corpus's prepared dataset: peak RSS, mean seconds per step after the first."""
    output_dir = workdir / "prep" / corpus.label
    manifests = sorted(output_dir.glob("*/manifest.json"))
    before = {path: path.stat().st_mtime_ns for path in manifests}
    entries = sorted(path.name for path in output_dir.iterdir())
    checkpoints = workdir / "train" / corpus.label
    metrics = workdir / "train" / f"{corpus.label}.metrics.jsonl"
    shutil.rmtree(checkpoints, ignore_errors=True)
    metrics.unlink(missing_ok=True)
    overrides = _overrides(workdir, corpus, output_dir, tokenizer)
    overrides += ["--set", f"train.steps={steps}", "--set", "train.log_interval=1", "--set", "train.eval_batches=1"]
    overrides += ["--set", f"train.checkpoint_interval={steps}", "--checkpoint-dir", str(checkpoints)]
    overrides += ["--metrics-jsonl", str(metrics)]
    measured = _llmflow(workdir, "train", overrides, f"train-{corpus.label}")
    after = {path: path.stat().st_mtime_ns for path in output_dir.glob("*/manifest.json")}
    if after != before or sorted(path.name for path in output_dir.iterdir()) != entries:
        raise RuntimeError(f"`llmflow train` prepared the {corpus.label} dataset again instead of reusing {output_dir}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    step_seconds = [
        (record["tokens_seen"] - previous["tokens_seen"]) / record["tokens_per_second"]
        for previous, record in itertools.pairwise(records)
    ]
    figures = {
        "peak_rss_mb": round(measured.peak_rss_bytes / 1e6, 1),
        "step_s": round(statistics.mean(step_seconds), 4),
        "step_s_median": round(statistics.median(step_seconds), 4),
        "wall_s": round(measured.wall_s, 2),
    }
    print(f"train {corpus.label}: {len(records)} steps, {figures['step_s']:.4f} s/step (steps 2-{len(records)}), "
          f"peak RSS {figures['peak_rss_mb']:,.0f} MB, {measured.wall_s:.1f} s in all", flush=True)
    return figures


def _combined(runs: list[dict]) -> dict:
    """One corpus's train runs as one: the highest peak RSS, the mean of the step times."""
    return {
        "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
        **{key: round(statistics.mean(run[key] for run in runs), 4) for key in ("step_s", "step_s_median", "wall_s")},
    }


def _prepared(stdout: str) -> tuple[Path, dict]:
    """The dataset directory and manifest `llmflow prep` reports; a reused dataset would time nothing."""
    match = PREPARED.search(stdout)
    if match is None:
        raise RuntimeError(f"`llmflow prep` did not report its dataset; its output:\n{stdout}")
    if match.group(1) != "prepared":
        raise RuntimeError(f"`llmflow prep` reused {match.group(2)} instead of preparing it")
    return Path(match.group(2)), json.loads(Path(match.group(3)).read_text())


def _llmflow(workdir: Path, command: str, arguments: list[str], log_name: str) -> Measured:
    """Run `llmflow COMMAND --params tiny ARGUMENTS` from this checkout, in workdir, measured."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PREFECT_HOME"] = str(workdir / "prefect")  # its own Prefect database, not one other runs share
    env.pop("MLFLOW_TRACKING_URI", None)  # it would win over tracking.uri
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    stdout_path, stderr_path = logs / f"{log_name}.out", logs / f"{log_name}.err"
    argv = [sys.executable, "-m", "flows.cli", command, "--params", "tiny", *arguments]
    with stdout_path.open("w") as stdout, stderr_path.open("w") as stderr:
        started, cpu_before = time.perf_counter(), _children_cpu_s()
        process = subprocess.Popen(argv, cwd=workdir, env=env, stdout=stdout, stderr=stderr)
        peak = _peak_tree_rss(process)
        wall_s, cpu_s = time.perf_counter() - started, _children_cpu_s() - cpu_before
    if process.returncode != 0:
        tail = stderr_path.read_text()[-4000:]
        command_line = " ".join(argv[2:])
        raise RuntimeError(f"`{command_line}` exited with {process.returncode}; the end of {stderr_path}:\n{tail}")
    return Measured(wall_s, cpu_s, peak, stdout_path.read_text())


def _children_cpu_s() -> float:
    """User and system seconds of every finished child and their finished descendants, so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _peak_tree_rss(process: subprocess.Popen) -> int:
    """Wait for the process; the peak over its life of the RSS summed over it and all its descendants."""
    root = psutil.Process(process.pid)
    peak, members, listed = 0, [], -TREE_SECONDS
    while process.poll() is None:
        total = 0
        if time.monotonic() - listed >= TREE_SECONDS:
            try:
                members = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            listed = time.monotonic()
        for member in members:
            try:
                total += member.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        peak = max(peak, total)
        time.sleep(SAMPLE_SECONDS)
    process.wait()
    return peak


# ----------------------------------------------------------------------------------------------- raw


def raw_encode(corpus: Corpus, tokenizer: Path, cores: int) -> tuple[int, float, float]:
    """Tokens, encoding seconds and encoding CPU seconds (every thread of this process) of every document
    of the corpus, read from its source files as prep reads them, batch by batch (reading untimed)."""
    processor = spm.SentencePieceProcessor(model_file=str(tokenizer))
    totals = [0, 0.0, 0.0]
    batch, chars = [], 0
    # The source files prep reads, not the corpus file: reading them here leaves them in the page cache for the
    # prep after, as prep's first read of them (hashing its inputs) would otherwise come from the disk.
    for path in _source_files(corpus):
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                text = json.loads(line)["text"]
                batch.append(text)
                chars += len(text)
                if chars >= RAW_BATCH_CHARS:
                    totals = [total + part for total, part in zip(totals, _encode(processor, batch, cores))]
                    batch, chars = [], 0
    if batch:
        totals = [total + part for total, part in zip(totals, _encode(processor, batch, cores))]
    tokens, seconds, cpu_seconds = totals
    return tokens, seconds, cpu_seconds


def _print_raw(when: str, corpus: Corpus, measured: tuple[int, float, float], cores: int) -> None:
    tokens, seconds, cpu_seconds = measured
    print(f"raw ({when}): {tokens:,} tokens of the {corpus.label} corpus in {seconds:.1f} s on {cores} threads "
          f"({tokens / seconds:,.0f} tokens/s, {cpu_seconds:.1f} CPU s)", flush=True)


def _encode(processor: spm.SentencePieceProcessor, texts: list[str], cores: int) -> tuple[int, float, float]:
    started, cpu_started = time.perf_counter(), time.process_time()
    ids = processor.encode(texts, num_threads=cores, return_type="numpy")
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return sum(len(one) for one in ids), seconds, cpu_seconds


def _git_head() -> str:
    git = ["git", "describe", "--always", "--dirty"]
    found = subprocess.run(git, cwd=REPO, capture_output=True, text=True, check=False)
    return found.stdout.strip() or "not a git checkout"


if __name__ == "__main__":
    main()
