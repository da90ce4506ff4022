"""`prepare_dataset`: corpus inputs -> cleaned, filtered, deduplicated documents -> tokenizer -> packed,
shuffled train/validation token shards plus a manifest, in a directory named by the hash of the inputs
and params, so an unchanged request reuses what is already there.

The steps keep their order (clean -> filter -> exact dedup -> split -> tokenize -> near dedup -> pack ->
shuffle rows) and run as map -> reduce -> map over input shards, each step in memory bounded by a shard
or a partition, never by the corpus:

1. map (shard_map.py), per input shard (a file, a byte range of a large one, Parquet row groups): read,
   clean, filter, drop repeats inside the shard, hash, split by keyed hash, tokenize, MinHash. When the
   tokenizer is trained, a sampling map runs first and the tokenizer trains on the merged sample.
2. reduce (global_dedup.py): exact duplicates across shards by hash partition, then near duplicates by
   LSH-band-key partition, settled in corpus order. The output is a keep mask per shard.
3. map (row_shuffle.py): each shard packs its kept documents into rows of its split's token stream (the
   kept documents in corpus order); rows go to positions of a keyed permutation of the split; each
   write bucket gathers one run of output shards from every pack file. Both splits pack in one step and
   write in the next, a job per worker and split, each holding one shard or one bucket at a time.

Steps run through a `Mapper` (engine.py): local worker processes by default, a Ray cluster through
Prefect in tasks/. The result does not depend on the mapper, the number of workers or data.shard_bytes:
documents are numbered in corpus order, and every choice is a keyed hash of a document's text or a
row's number. Map results are cached under data.output_dir/.work by the shard's content, the params
and the tokenizer, so a run after new files landed maps only those (dedup and packing see everything).
The dataset is built in a temporary sibling directory and renamed into place, so a failure or a kill
never leaves a final directory behind.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model_core.data import dedup, global_dedup, health, row_shuffle, shard_map
from model_core.data.docstrings import stdlib_fingerprint
from model_core.data.engine import LocalMapper, Mapper, available_cores, run_jobs
from model_core.data.errors import DataPrepError
from model_core.data.input_shards import InputShard, file_identity, plan_shards
from model_core.data.shards import (
    MANIFEST_NAME,
    TOKENIZER_NAME,
    DatasetDamagedError,
    read_manifest,
    shard_file_bytes,
    write_manifest,
)
from model_core.data.sources import FileReport, InputFile, fingerprint, list_inputs
from model_core.data.tokenizer import load_tokenizer, open_tokenizer, train_tokenizer, train_tokenizer_apart
from model_core.storage import commit_directory, file_sha256, write_file
from params.schema import DataParams, ModelParams, TokenizerParams

FORMAT_VERSION = 4  # 3: map/reduce prep, split by keyed hash, flat token shards; 4: rows of one source each
# How this build went (timings, jobs, workers, what it took from the .work cache), beside the manifest and
# never in it: the manifest describes only the content, so identical datasets have identical manifests
# however they were built (interrupted and rerun, any workers or shard size).
REPORT_NAME = "prep_report.json"
CACHE_DIR = ".cache"  # under data.output_dir: the extracted standard-library docstrings
WORK_DIR = ".work"  # under data.output_dir: map results kept for later runs, and each build's scratch
MAX_REPORTED_RECORDS = shard_map.MAX_REPORTED_RECORDS
# Params that change where or how fast the data is made, not what it is.
_NON_DATA_PARAMS = {
    "output_dir", "num_workers", "runner", "ray_address", "ray_connect_timeout_s", "shard_bytes", "verify_on_reuse",
    "health",  # thresholds of warnings about the data, which is the same whatever they are
}
# How training mixes the sources, not what any source's rows hold.
_MIXTURE_FIELDS = {"name", "weight", "epochs"}
# A tokenizer sample of at most this many lines trains in the prep process: its trainer's memory (tens of MB)
# is less than a child process costs to start (an interpreter and the data modules imported again).
TRAIN_HERE_LINES = 50_000
_PROGRESS_LOG_SECONDS = 10.0
_PROGRESS_POLL_SECONDS = 2.0

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, "int | None"], None]


@dataclass(frozen=True)
class PrepResult:
    output_dir: Path
    manifest: dict
    manifest_path: Path
    tokenizer_path: Path
    reused: bool
    report: dict  # prep_report.json of the build that made the dataset ({} where there is none)


def prepare_dataset(
    data: DataParams,
    tokenizer: TokenizerParams,
    model: ModelParams,
    progress: Progress | None = None,
    mapper: Mapper | None = None,
) -> PrepResult:
    if mapper is None:
        with LocalMapper(data.num_workers or available_cores()) as local:
            return prepare_dataset(data, tokenizer, model, progress, local)
    progress = progress or (lambda stage, done, total: None)
    workers = data.num_workers or available_cores()
    inputs = list_inputs(data.sources)
    work = Path(data.output_dir).resolve() / WORK_DIR
    contents = _content_hashes(inputs, work, mapper, progress, workers if _several_shards(inputs, data) else 0)
    params = data_params(data, tokenizer, model)
    input_fingerprint = fingerprint(inputs, contents)
    key = _hash({"params": params, "inputs": input_fingerprint})[:16]
    final_dir = Path(data.output_dir).resolve() / key

    if final_dir.exists():
        problem = verify_dataset(final_dir, full=data.verify_on_reuse == "sha256")
        if problem is None:
            return prepared(final_dir, reused=True)
        logger.warning("prepared dataset %s is damaged (%s); rebuilding it", final_dir, problem)

    final_dir.parent.mkdir(parents=True, exist_ok=True)
    (work / "builds").mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(final_dir.parent, work / "builds")
    owner = f"{socket.gethostname()}-{os.getpid()}"
    build_dir = Path(tempfile.mkdtemp(prefix=f".{key}.building-{owner}-", dir=final_dir.parent))
    scratch = Path(tempfile.mkdtemp(prefix=f"{key}-{owner}-", dir=work / "builds"))
    try:
        build = _Build(data, tokenizer, model, mapper, progress, build_dir, scratch, work, workers)
        shards = plan_shards(inputs, data.shard_bytes, contents)
        manifest = build.run(shards)
        manifest.update(key=key, params=params, params_hash=_hash(params), input_fingerprint=input_fingerprint)
        # The files it was made from and their content, for lineage (identity.py): the fingerprint alone names none.
        manifest["inputs"] = [{"path": str(item.path), "sha256": contents[item.path]} for item in inputs]
        write_manifest(build_dir, manifest)
        (build_dir / REPORT_NAME).write_text(json.dumps(build.report(workers), indent=2) + "\n")
        commit_directory(build_dir, final_dir, replace=True)  # a damaged copy under the name is replaced
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return prepared(final_dir, reused=False)


def vocab_padding(model: ModelParams) -> dict:
    """The model's vocabulary padding where it has some: it decides the tokenizer's size, and a dataset key
    without padding stays what it was before the field existed."""
    return {"vocab_padding": model.vocab_padding} if model.vocab_padding else {}


def data_params(data: DataParams, tokenizer: TokenizerParams, model: ModelParams) -> dict:
    """Everything that decides the content of the dataset (a loaded tokenizer counts by its bytes)."""
    tokenizer_params = tokenizer.model_dump(exclude={"model_path"})
    if tokenizer.model_path is not None:
        given = Path(tokenizer.model_path)
        tokenizer_params["model_sha256"] = file_sha256(given) if given.is_file() else None
    return {
        "format_version": FORMAT_VERSION,
        "data": data.model_dump(exclude={**dict.fromkeys(_NON_DATA_PARAMS, True), "sources": {"__all__": _MIXTURE_FIELDS}}),
        "tokenizer": tokenizer_params,
        "model": {"vocab_size": model.vocab_size, "seq_len": model.seq_len, **vocab_padding(model)},
    }


def verify_dataset(directory: Path, full: bool = False) -> str | None:
    """None when the manifest (by manifest.sha256), the tokenizer (by sha256) and every shard it lists are
    intact, else what is wrong. Shards are checked by their size, or with `full` by their sha256: hashing
    terabytes of shards on every reuse (each `llmflow train` start) would take longer than many runs, and
    training checks each shard's sha256 when it first reads it."""
    try:
        manifest = read_manifest(directory)
    except DatasetDamagedError as error:
        return error.problem
    except (OSError, ValueError) as error:
        return f"unreadable {MANIFEST_NAME}: {error}"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"format_version {manifest.get('format_version')} is not {FORMAT_VERSION}"
    files = [(TOKENIZER_NAME, manifest["tokenizer"]["sha256"], None)]
    row_len = manifest["seq_len"] + 1
    for split in manifest["splits"].values():
        files += [(shard["file"], shard["sha256"], shard_file_bytes(shard, row_len)) for shard in split["shards"]]
    for name, expected, size in files:
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if size is not None and not full:
            if path.stat().st_size != size:
                return f"{name} holds {path.stat().st_size} bytes, not the {size} its manifest entry gives"
        elif file_sha256(path) != expected:
            return f"{name} does not match its sha256 in the manifest"
    return None


def _several_shards(inputs: list[InputFile], data: DataParams) -> bool:
    """Whether the inputs make more than one input shard, judged by their sizes alone (no file is read)."""
    return len(inputs) > 1 or any(item.path.is_file() and item.path.stat().st_size > data.shard_bytes for item in inputs)


def _content_hashes(
    inputs: list[InputFile], work: Path, mapper: Mapper, progress: Progress, workers: int = 0
) -> dict[Path, str]:
    """The sha256 of every input file, hashed (by the mapper's workers) only when its path, size, mtime or
    inode changed since a run last hashed it; the standard library by its `stdlib_fingerprint`. When some
    input is hashed and `workers` is set, the mapper's workers start meanwhile (a new corpus goes on to
    the map step)."""
    cache = work / "file-hashes"
    known: dict[Path, str] = {}
    missing: list[Path] = []
    for item in inputs:
        if item.path.is_dir():
            known[item.path] = stdlib_fingerprint()
            continue
        entry = cache / hashlib.sha256(file_identity(item.path).encode()).hexdigest()[:32]
        try:
            known[item.path] = entry.read_text().strip()
        except OSError:
            missing.append(item.path)
    progress("hash inputs", 0, len(missing))
    # A worker takes over a second to start (interpreter, imports), and one large input is hashed here, on
    # one core: started now, the workers use the cores the hashing leaves idle instead of holding up the map.
    starting = mapper("start workers", shard_map.worker_ready, list(range(workers))) if missing and workers > 1 else ()
    for done, (path, digest) in enumerate(zip(missing, mapper("hash inputs", file_sha256, missing)), 1):
        known[path] = digest
        write_file(cache / hashlib.sha256(file_identity(path).encode()).hexdigest()[:32], digest)
        progress("hash inputs", done, len(missing))
    for _ in starting:  # a worker that cannot start fails here, not in the middle of the map
        pass
    return known


class _Build:
    """One dataset build: the steps in order, their results, and what they report."""

    def __init__(
        self,
        data: DataParams,
        tokenizer: TokenizerParams,
        model: ModelParams,
        mapper: Mapper,
        progress: Progress,
        build_dir: Path,
        scratch: Path,
        work: Path,
        workers: int,
    ) -> None:
        self.data, self.tokenizer, self.model = data, tokenizer, model
        self.mapper, self.progress = mapper, progress
        self.build_dir, self.scratch, self.work, self.workers = build_dir, scratch, work, workers
        self.seconds: dict[str, float] = {}
        self.jobs: dict[str, int] = {}
        self.reuse: dict[str, int] = {}
        self.tokenizer_peak_rss_bytes: int | None = None  # the training child's, where one trained it

    def run(self, shards: list[InputShard]) -> dict:
        self.single_shard = len(shards) == 1
        self.shard_sources = [shard.input.source for shard in shards]
        threads = max(1, self.workers // max(1, min(self.workers, len(shards))))
        tokenizer_info, tokenizer_path = self._tokenizer(shards, threads)
        results = self._map(shards, threads, tokenizer_path, tokenizer_info["sha256"])
        read_counts = check_bad_records(results, self.data.max_bad_record_fraction)
        plan = self._plan(results)
        across_shards = self._exact_dedup(plan)
        dropped, steps = _filter_counts(results, self.data, across_shards)
        near = self._near_dedup(plan)
        if self.data.near_dup_threshold is not None:
            kept_before = steps[-1]["out"]
            dropped["near_duplicate"] = near
            steps.append({"step": "near_duplicate", "in": kept_before, "out": kept_before - near})
        kept = steps[-1]["out"] if steps else plan.documents
        splits = self._pack_and_write(plan)
        if splits["train"]["rows"] == 0:
            raise DataPrepError(
                f"the {splits['train']['documents']} training documents make {splits['train']['tokens']} tokens, "
                f"less than one row of model.seq_len + 1 = {self.model.seq_len + 1}"
            )
        data_health = self._health(shards)
        return {
            "format_version": FORMAT_VERSION,
            "counts": {**read_counts, "dropped": dropped, "kept_documents": kept},
            "steps": steps,
            "split": f"a document is held out when its keyed text hash is in the lowest "
            f"data.validation_fraction={self.data.validation_fraction} of the hash range",
            "near_dedup": {
                "shingle": f"{self.data.shingle_words} consecutive token ids (data.shingle_words counts tokens)",
                "signature": f"one-permutation MinHash, {self.data.minhash_permutations} positions, optimal densification",
            },
            "bad_records": read_counts.pop("examples"),
            "tokenizer": tokenizer_info,
            "vocab_size": self.model.vocab_size,
            **vocab_padding(self.model),
            "seq_len": self.model.seq_len,
            "splits": splits,
            "health": data_health,
        }

    def report(self, workers: int) -> dict:
        return {
            "timings_s": {stage: round(seconds, 4) for stage, seconds in self.seconds.items()},
            "jobs": self.jobs,
            "workers": workers,
            "reuse": self.reuse,
            **({"tokenizer_peak_rss_bytes": self.tokenizer_peak_rss_bytes} if self.tokenizer_peak_rss_bytes else {}),
        }

    def _run_step(
        self,
        stage: str,
        function: Callable,
        jobs: list,
        sizes: list[int] | None = None,
        outputs: list[Path] | None = None,
    ) -> list:
        """Every job's result in order, reporting progress as they arrive. With `outputs` (each job's result
        directory), progress also counts the jobs whose results appear there while the step runs: a mapper
        hands results back a batch of jobs at a time, and on a cluster the first batches hold half the step."""
        watch = _StepProgress(stage, len(jobs), sizes, self.progress)
        results = []
        with _watching_outputs(watch, outputs):
            for index, result in enumerate(self.mapper(stage, function, jobs)):
                results.append(result)
                watch.update(index, result)
                # A mapper returns a batch's results all at once: a line logged at the first of them would
                # give its rates and ETA from one job where the batch held many, so with a poll the poll logs.
                if outputs is None:
                    watch.log_if_due()
        watch.finish()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + watch.elapsed
        self.jobs[stage] = len(jobs)
        return results

    def _run_step_of_small_jobs(self, stage: str, function: Callable, jobs: list) -> list:
        """`_run_step` of the jobs dealt out in turn to a batch per worker (one batch, run in this thread, for a
        corpus of one input shard), the results in job order. A job here (packing a run of shards of one
        split, writing a run of buckets) takes about what starting a task run costs, so a task run per job
        doubled the runs for nothing; the jobs come a run per worker for each split in turn, so dealing
        them gives each batch one run of each split."""
        count = 1 if self.single_shard else max(1, min(self.workers, len(jobs)))
        batches = [jobs[first::count] for first in range(count)]
        ordered: list = [None] * len(jobs)
        for first, results in enumerate(self._run_step(stage, functools.partial(run_jobs, function), batches)):
            ordered[first::count] = results
        return ordered

    def _shard_job(self, shard: InputShard, threads: int, directory: Path, tokenizer_path: Path | None = None):
        return shard_map.ShardJob(
            shard, self.data, self.tokenizer, self.model.vocab_size, threads, directory,
            Path(self.data.output_dir).resolve() / CACHE_DIR, tokenizer_path, self.model.vocab_padding,
        )

    def _tokenizer(self, shards: list[InputShard], threads: int) -> tuple[dict, Path]:
        """The tokenizer's manifest entry and its file in the build: loaded from tokenizer.model_path, or
        trained on the bottom-k sample of the training documents' lines."""
        started = time.perf_counter()
        if self.tokenizer.model_path is not None:
            model_bytes, origin = load_tokenizer(Path(self.tokenizer.model_path)), f"tokenizer {self.tokenizer.model_path}"
        else:
            sample_params = self._map_params("sample", training_sentences=self.tokenizer.training_sentences)
            jobs = [self._shard_job(s, threads, self._cache_dir("sample", s, sample_params)) for s in shards]
            sizes = [shard_map.shard_size(s) for s in shards]
            results = self._run_step("sample", shard_map.sample_shard, jobs, sizes, [job.output for job in jobs])
            self.reuse["sample_shards_reused"] = sum(bool(r.get("reused")) for r in results)
            check_bad_records(results, self.data.max_bad_record_fraction, log=False)  # logged after the map step
            _filter_counts(results, self.data, 0)  # fails on an empty corpus before training on nothing
            model_bytes = self._train_tokenizer([job.output for job in jobs], sum(r["lines"] for r in results))
            origin = "the trained tokenizer"
        open_tokenizer(model_bytes, self.tokenizer, self.model.vocab_size, origin, self.model.vocab_padding)
        path = self.build_dir / TOKENIZER_NAME
        path.write_bytes(model_bytes)
        self.seconds["tokenizer"] = time.perf_counter() - started
        info = {
            "file": TOKENIZER_NAME,
            "sha256": hashlib.sha256(model_bytes).hexdigest(),
            "trained": self.tokenizer.model_path is None,
            "origin": origin,
            "vocab_size": self.model.vocab_size,
            **{name: getattr(self.tokenizer, name) for name in ("unk_id", "bos_id", "eos_id", "pad_id")},
        }
        return info, path

    def _train_tokenizer(self, samples: list[Path], sampled_lines: int) -> bytes:
        """The tokenizer trained on the merged sample: in a child process (its memory ends with it) unless the
        sample is small enough that starting a process would cost more than the memory it hands back."""
        lines = functools.partial(_merged_sample, samples, self.tokenizer.training_sentences)
        arguments = (self.tokenizer, self.model.unpadded_vocab_size, self.data.shuffle_seed, self.workers)
        if min(sampled_lines, self.tokenizer.training_sentences) <= TRAIN_HERE_LINES:
            return train_tokenizer(lines(), *arguments)
        model_bytes, peak_bytes = train_tokenizer_apart(lines, *arguments)
        self.tokenizer_peak_rss_bytes = peak_bytes
        return model_bytes

    def _map_params(self, step: str, **extra: object) -> dict:
        fields = {"normalize_unicode", "min_chars", "max_chars", "dedup_exact", "shuffle_seed", "validation_fraction"}
        if step == "map":
            fields |= {"near_dup_threshold", "shingle_words", "minhash_permutations"}
        return {"format_version": FORMAT_VERSION, "step": step, **self.data.model_dump(include=fields), **extra}

    def _cache_dir(self, step: str, shard: InputShard, params: dict) -> Path:
        return self.work / step / _hash({"shard": shard.identity(), "params": params})[:32]

    def _map(self, shards: list[InputShard], threads: int, tokenizer_path: Path, tokenizer_sha256: str) -> list[dict]:
        # The tokenizer is copied into the work directory: the build directory may be on a disk the
        # workers of a cluster do not see, while data.output_dir must be shared.
        shared_tokenizer = self.scratch / TOKENIZER_NAME
        shutil.copyfile(tokenizer_path, shared_tokenizer)
        params = self._map_params(
            "map",
            tokenizer_sha256=tokenizer_sha256,
            vocab_size=self.model.vocab_size,
            near=self.data.near_dup_threshold is not None,
            characters=True,  # a result holds its documents' characters (fertility): one without them is not reused
        )
        # The last shards encode on as many threads as there are workers: a worker still on one of them when
        # the others have none left then takes their cores, where one thread left them idle (on 2 cores and
        # 8 MiB shards, for about half a shard's time at the end of every map).
        tail = len(shards) - self.workers if len(shards) > self.workers else len(shards)
        jobs = [
            self._shard_job(s, threads if index < tail else self.workers, self._cache_dir("map", s, params), shared_tokenizer)
            for index, s in enumerate(shards)
        ]
        results = self._run_step(
            "map", shard_map.map_shard, jobs, [shard_map.shard_size(s) for s in shards], [job.output for job in jobs]
        )
        self.reuse["input_shards"] = len(shards)
        self.reuse["map_shards_reused"] = sum(bool(r.get("reused")) for r in results)
        for job, result in zip(jobs, results):
            result["directory"] = str(job.output)
        return results

    def _plan(self, results: list[dict]) -> global_dedup.Plan:
        directories = [Path(r["directory"]) for r in results]
        first = np.concatenate([[0], np.cumsum([r["documents"] for r in results])]).astype(int).tolist()
        plan = global_dedup.Plan(directories, first)
        plan.save(self.scratch / "plan.json")
        for shard, result in enumerate(results):
            np.save(plan.keep_path(self.scratch, shard), np.ones(result["documents"], dtype=bool))
        return plan

    def _exact_dedup(self, plan: global_dedup.Plan) -> int:
        """Repeats of a text in another, earlier shard (those inside a shard went in its map step)."""
        if not self.data.dedup_exact or len(plan.directories) < 2:
            return 0
        count = global_dedup.partitions_for(
            plan.documents, global_dedup.EXACT_ENTRY_BYTES, self.workers, global_dedup.EXACT_PARALLEL_DOCUMENTS
        )
        jobs = [global_dedup.ReduceJob(self.scratch / "plan.json", self.scratch, p, count) for p in range(count)]
        self._run_step("exact dedup", global_dedup.exact_partition, jobs)
        return global_dedup.drop_from_keep_masks(plan, self.scratch, [job.output for job in jobs], None)

    def _near_dedup(self, plan: global_dedup.Plan) -> int:
        threshold = self.data.near_dup_threshold
        if threshold is None:
            return 0
        bands = self.data.minhash_permutations // dedup.rows_per_band(self.data.minhash_permutations, threshold)
        # Per document: its band keys, and its signature wherever one of them lands.
        count = global_dedup.partitions_for(
            plan.documents,
            bands * global_dedup.NEAR_ENTRY_BYTES + 4 * self.data.minhash_permutations,
            self.workers,
            global_dedup.NEAR_PARALLEL_DOCUMENTS,
        )
        jobs = [global_dedup.ReduceJob(self.scratch / "plan.json", self.scratch, p, count, threshold) for p in range(count)]
        self._run_step("near dedup", global_dedup.near_partition, jobs)
        started = time.perf_counter()
        pairs = [np.load(job.output) for job in jobs]
        dropped = global_dedup.settle_near_duplicates(np.concatenate(pairs) if pairs else np.empty((0, 2), np.int64))
        global_dedup.drop_from_keep_masks(plan, self.scratch, None, dropped)
        self.seconds["near dedup"] += time.perf_counter() - started
        return len(dropped)

    def _pack_and_write(self, plan: global_dedup.Plan) -> dict[str, dict]:
        """Pack, shuffle and write both splits, in one pack step and one write step; their manifest entries."""
        plan_path = self.scratch / "plan.json"
        packings, lengths, rows, streams = {}, {}, {}, {}
        for split in row_shuffle.SPLITS:
            packings[split] = self._packing(split)
            lengths[split] = row_shuffle.stream_lengths(plan, self.scratch, split, self.data.add_bos)
            _check_split(split, sum(lengths[split][0]), self.data.validation_fraction)
            streams[split] = row_shuffle.SplitStream.of(
                lengths[split][1], self.shard_sources, len(self.data.sources), packings[split]
            )
            streams[split].save(row_shuffle.stream_path(self.scratch, split))
            rows[split] = sum(streams[split].rows)
        # A job per worker and split: packing a shard or writing a bucket takes less than a task run costs.
        pack_jobs = [
            row_shuffle.PackJob(plan_path, self.scratch, packings[split], first, end)
            for split in row_shuffle.SPLITS
            for first, end in row_shuffle.job_runs(len(plan.directories), self.workers)
        ]
        self._run_step_of_small_jobs("pack", row_shuffle.pack_shards, pack_jobs)
        write_jobs = [
            row_shuffle.WriteJob(plan_path, self.scratch, self.build_dir, packings[split], rows[split], first, end)
            for split in row_shuffle.SPLITS
            for first, end in row_shuffle.job_runs(len(row_shuffle.buckets(rows[split], packings[split])), self.workers)
        ]
        shards: dict[str, list[dict]] = {split: [] for split in row_shuffle.SPLITS}
        for job, entries in zip(write_jobs, self._run_step_of_small_jobs("write", row_shuffle.write_buckets, write_jobs)):
            shards[job.packing.split] += entries
        return {
            split: {
                "documents": sum(lengths[split][0]),
                "tokens": sum(lengths[split][1]),
                "rows": rows[split],
                "packed_tokens": sum(shard["tokens"] for shard in shards[split]),
                "sources": _source_counts(lengths[split], streams[split], packings[split].within_sources),
                "shards": shards[split],
            }
            for split in row_shuffle.SPLITS
        }

    def _health(self, shards: list[InputShard]) -> dict:
        """The manifest's data-health section: the training rows measured a run of input shards per job, then
        merged per source and judged against data.health (health.py)."""
        runs = row_shuffle.job_runs(len(shards), self.workers)
        packing = self._packing("train")
        jobs = [health.HealthJob(self.scratch, packing, *run, self.data.shingle_words) for run in runs]
        measured = [shard for job in self._run_step_of_small_jobs("health", health.measure_shards, jobs) for shard in job]
        started = time.perf_counter()
        unknown = health.unknown_ids(self.build_dir / TOKENIZER_NAME)
        sources = health.shard_sources(self.data.sources, shards)
        section = health.summarize(measured, sources, self.scratch, unknown, self.data.health)
        self.seconds["health"] += time.perf_counter() - started
        return section

    def _packing(self, split: str) -> row_shuffle.Packing:
        return row_shuffle.Packing(
            split=split,
            row_len=self.model.seq_len + 1,
            bos_id=self.tokenizer.bos_id if self.data.add_bos else None,
            eos_id=self.tokenizer.eos_id,
            pad_id=self.tokenizer.pad_id,
            pad_last_row=self.data.last_row == "pad",
            seed=self.data.shuffle_seed,
            rows_per_shard=self.data.rows_per_shard,
            vocab_size=self.model.vocab_size,
            shards_per_bucket=row_shuffle.shards_per_bucket(self.data.rows_per_shard, self.model.seq_len + 1),
            within_sources=split == "train",  # the sampler reads each source's range; validation is read in file order
        )


def _source_counts(lengths: tuple[list[int], list[int]], stream: row_shuffle.SplitStream, ranges: bool) -> list[dict]:
    """Per data source, in data.sources order: its kept documents, stream tokens and rows in the split, and
    where `ranges` (training rows shuffled within their source) the first of its rows in the split's files."""
    counts = [{"documents": 0, "tokens": 0, "rows": rows} for rows in stream.rows]
    for documents, tokens, source in zip(*lengths, stream.sources):
        counts[source]["documents"] += documents
        counts[source]["tokens"] += tokens
    if ranges:
        for source, entry in enumerate(counts):
            entry["first_row"] = stream.first_row(source)
    return counts


def _check_split(split: str, documents: int, fraction: float) -> None:
    if split == "train" and documents == 0:
        raise DataPrepError(
            f"data.validation_fraction={fraction} left no training document: every kept document was held out"
        )
    if split == "validation" and fraction > 0 and documents == 0:
        raise DataPrepError(
            f"data.validation_fraction={fraction} held out none of the kept documents (a document is held out by "
            "its keyed hash); raise the fraction or add documents"
        )


def _merged_sample(directories: Iterable[Path], limit: int) -> list[str]:
    """The `limit` lines with the smallest keys over every shard's sample, in key order; at most about
    2 * limit lines are held at once."""
    keys, lines = np.empty(0, dtype=np.uint64), []
    for directory in directories:
        shard_keys, shard_lines = shard_map.read_sample(directory)
        keys, lines = np.concatenate([keys, shard_keys]), lines + shard_lines
        keys, lines = shard_map.smallest_keys(keys, lines, limit)
    return lines


def check_bad_records(results: list[dict], max_fraction: float, log: bool = True) -> dict:
    """Log the bad records that the map steps found (unless `log` is False), fail when malformed ones
    exceed the allowed share, return the read counts (with up to MAX_REPORTED_RECORDS examples, in
    corpus order)."""
    records = sum(r["records"] for r in results)
    malformed = sum(r["malformed"] for r in results)
    undecodable = sum(r["undecodable"] for r in results)
    examples = [example for r in results for example in r["examples"]][:MAX_REPORTED_RECORDS]
    for example in examples if log else ():
        logger.warning("bad record %s", example)
    if log and (malformed or undecodable):
        logger.warning(
            "%d malformed records skipped and %d lines with undecodable bytes kept, of %d records",
            malformed,
            undecodable,
            records,
        )
    if records and malformed / records > max_fraction:
        first = next(r["first_malformed"] for r in results if r["first_malformed"])
        raise DataPrepError(
            f"{malformed} of {records} records ({malformed / records:.2%}) are malformed, more than "
            f"data.max_bad_record_fraction={max_fraction}; first: {first}"
        )
    return {"records": records, "malformed": malformed, "undecodable": undecodable, "examples": examples}


def _check_bad_records(reports: list[FileReport], max_fraction: float) -> dict:
    """`check_bad_records` of whole-file read reports (instruction prep reads its files in one piece)."""
    results = []
    for report in reports:
        malformed = [f"{report.path}:{line}: {reason}" for line, reason in report.malformed]
        undecodable = [f"{report.path}:{line}: undecodable bytes replaced" for line in report.undecodable_lines]
        results.append(
            {
                "records": report.records,
                "malformed": len(malformed),
                "undecodable": len(undecodable),
                "examples": (malformed + undecodable)[:MAX_REPORTED_RECORDS],
                "first_malformed": malformed[0] if malformed else None,
            }
        )
    return check_bad_records(results, max_fraction)


def _filter_counts(results: list[dict], data: DataParams, exact_across_shards: int) -> tuple[dict, list]:
    """The count dropped per reason and each step's documents in and out, summed over the shards (exact
    repeats inside a shard, counted by its map step, and across shards, by the reduce)."""
    steps = [*shard_map.FILTER_STEPS] + (["exact_duplicate"] if data.dedup_exact else [])
    seen = {step: sum(r["seen"][step] for r in results) for step in steps}
    dropped = {step: sum(r["dropped"][step] for r in results) for step in (*shard_map.FILTER_STEPS, "exact_duplicate")}
    dropped["exact_duplicate"] += exact_across_shards
    dropped["near_duplicate"] = 0
    if sum(r["documents"] for r in results) == exact_across_shards:
        counts = ", ".join(f"{reason}={count}" for reason, count in dropped.items())
        raise DataPrepError(f"no document is left after cleaning, filtering and deduplication ({counts})")
    return dropped, [{"step": step, "in": seen[step], "out": seen[step] - dropped[step]} for step in steps]


class _StepProgress:
    """Per step: the `progress` callback after every job, and a log line (`log_if_due`) at most every
    _PROGRESS_LOG_SECONDS and at the end with documents/s, tokens/s, MB read and the ETA. Jobs are counted
    once, whether the mapper or a poll of their outputs reports them first; the two may call from
    different threads."""

    def __init__(self, stage: str, jobs: int, sizes: list[int] | None, progress: Progress) -> None:
        self.stage, self.jobs, self.progress = stage, jobs, progress
        self.total_bytes = sum(sizes) if sizes else None
        self.counted: set[int] = set()
        self.documents = self.tokens = self.bytes = 0
        self.started = self._logged = time.perf_counter()
        self._lock = threading.Lock()
        progress(stage, 0, jobs)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def update(self, index: int, result: object) -> None:
        with self._lock:
            if index in self.counted:
                return
            self.counted.add(index)
            if isinstance(result, dict):
                self.documents += result.get("documents", 0)
                self.tokens += result.get("tokens", 0)
                self.bytes += result.get("bytes", 0)
            self.progress(self.stage, len(self.counted), self.jobs)

    def log_if_due(self) -> None:
        with self._lock:
            if time.perf_counter() - self._logged >= _PROGRESS_LOG_SECONDS:
                self._log()

    def finish(self) -> None:
        with self._lock:
            if self.jobs:
                self._log()

    def _log(self) -> None:
        self._logged = now = time.perf_counter()
        seconds = max(now - self.started, 1e-9)
        done = len(self.counted)
        parts = [f"{self.stage}: {done}/{self.jobs} jobs"]
        if self.documents:
            parts.append(f"{self.documents:,} documents ({self.documents / seconds:,.0f}/s)")
        if self.tokens:
            parts.append(f"{self.tokens:,} tokens ({self.tokens / seconds:,.0f}/s)")
        if self.bytes:
            parts.append(f"{self.bytes / 1e6:,.1f} MB read ({self.bytes / 1e6 / seconds:,.1f} MB/s)")
        share = self.bytes / self.total_bytes if self.total_bytes and self.bytes else done / max(self.jobs, 1)
        if 0 < share < 1:
            parts.append(f"ETA {_duration(seconds * (1 - share) / share)}")
        parts.append(f"{_duration(seconds)} elapsed")
        logger.info(", ".join(parts))


@contextmanager
def _watching_outputs(watch: _StepProgress, outputs: list[Path] | None) -> Iterator[None]:
    """While the block runs, a thread counts the jobs whose result directory (`outputs[i]`, all in one
    parent) has appeared: one listing of the parent a poll, so a poll costs the same for 100 jobs or 100,000,
    and a result there is finished (each is renamed into place whole). Polls are spaced by
    _PROGRESS_POLL_SECONDS, or 20 times the last poll's time when a large listing on a network file system
    takes longer, so polling never takes more than a twentieth of a core."""
    if not outputs:
        yield
        return
    parent = outputs[0].parent
    pending = {path.name: index for index, path in enumerate(outputs)}
    stop = threading.Event()

    def poll() -> None:
        try:
            names = os.listdir(parent)
        except OSError:  # not made yet: no job has finished
            return
        for name in names:
            index = pending.get(name)
            if index is None:
                continue
            result = shard_map.finished_result(parent / name)
            if result is not None:
                del pending[name]
                watch.update(index, result)
        watch.log_if_due()

    def run() -> None:
        wait = _PROGRESS_POLL_SECONDS
        while pending and not stop.wait(wait):
            started = time.perf_counter()
            try:
                poll()
            except Exception:  # progress must never fail the step; the mapper's results still count every job
                logger.debug("polling %s for finished jobs failed", parent, exc_info=True)
                return
            wait = max(_PROGRESS_POLL_SECONDS, 20 * (time.perf_counter() - started))

    # In a copy of this thread's context: the progress callback and log handlers may look up run state
    # (an orchestrator's) in context variables, which a new thread would start without.
    context = contextvars.copy_context()
    poller = threading.Thread(target=context.run, args=(run,), name=f"{watch.stage} progress", daemon=True)
    poller.start()
    try:
        yield
    finally:
        stop.set()
        poller.join()


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def _remove_abandoned_builds(*parents: Path) -> None:
    """Delete the build and scratch directories of killed runs on this host (their process is gone); the
    map results they finished stay cached under .work for the next run."""
    pattern = re.compile(rf"(?:\.\w+\.building-|\w+-){re.escape(socket.gethostname())}-(\d+)-")
    for parent in parents:
        for entry in parent.iterdir():
            found = pattern.match(entry.name)
            if found and entry.is_dir() and not _alive(int(found.group(1))):
                shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepared(directory: Path, reused: bool) -> PrepResult:
    """The result of a prepared dataset directory (its manifest read)."""
    manifest_path = directory / MANIFEST_NAME
    report_path = directory / REPORT_NAME
    return PrepResult(
        output_dir=directory,
        manifest=json.loads(manifest_path.read_text()),
        manifest_path=manifest_path,
        tokenizer_path=directory / TOKENIZER_NAME,
        reused=reused,
        report=json.loads(report_path.read_text()) if report_path.is_file() else {},
    )


def _rng(seed: int, stream: str) -> np.random.Generator:
    """An independent, reproducible random stream per purpose (instruction prep's example order)."""
    return np.random.default_rng([seed % 2**64, int.from_bytes(stream.encode(), "little")])


def _hash(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()

