"""Throughput and peak memory of ``lightning-4d prepare-data`` on a JSON Lines corpus, beside ``tokenizers``' own
``encode_batch`` on the same text.

``python benchmarks/prepare_data.py [--size-gb 2] [--workers 1 2] [--dir DIR]``:

1. writes a synthetic JSON Lines corpus of ``--size-gb`` GB (records of about 2 KB of Zipf-distributed pseudo-words,
   sentences and numbers, ``{"id": ..., "text": ...}``);
2. trains a byte-level BPE of ``--vocab-size`` (32,000) on its first 16 MB with ``tokenizers``;
3. runs ``prepare-data`` once per ``--workers`` value, each in a fresh process (``python -m lightning_4d``, the
   import not timed), and reports MB/s of input, MB/s per worker, and the peak RSS of the main process
   (``getrusage(RUSAGE_SELF).ru_maxrss``) and of the largest worker (``RUSAGE_CHILDREN``);
4. times ``tokenizers.Tokenizer.encode_batch`` (``add_special_tokens=True``) alone over the same texts, single-threaded
   (``TOKENIZERS_PARALLELISM=false``, ``RAYON_NUM_THREADS=1``), in batches of 1 MB, JSON parsing not timed,
   and prints the ratio of its MB/s to prepare-data's MB/s per worker, and the same ratio per CPU-second (user +
   system time of prepare-data's main process and workers: the figure that a machine shared with other work
   distorts least).

Targets: peak RSS below 1.5 GB for every process; per-worker throughput within 1.5x of ``encode_batch``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SINGLE_THREAD = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}


def write_corpus(path: Path, size_bytes: int, seed: int = 0) -> int:
    """A JSON Lines corpus of about ``size_bytes``: a pool of 4,000 synthetic documents written in a new order each
    round, each record with its own id. Returns the number of records."""
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "st", "ing", "er", "qu"]
    words = sorted({"".join(rng.choice(syllables, size=rng.integers(1, 5))) for _ in range(40_000)})
    rng.shuffle(words)
    cdf = np.cumsum(1.0 / np.arange(1, len(words) + 1))
    cdf /= cdf[-1]
    pool = []
    for _ in range(4000):
        sentences = []
        for _ in range(max(1, int(rng.lognormal(3.0, 0.6)))):
            drawn = np.searchsorted(cdf, rng.random(int(rng.integers(5, 25))))
            picked = [words[min(i, len(words) - 1)] for i in drawn]
            if rng.random() < 0.3:
                picked.insert(int(rng.integers(len(picked))), str(int(rng.integers(0, 10**6))))
            sentences.append(" ".join(picked).capitalize() + rng.choice([".", ".", ".", "?", "!", ","]))
        pool.append(" ".join(sentences) + ("\n\n" if rng.random() < 0.5 else ""))
    count = 0
    written = 0
    with open(path, "w") as f:
        while written < size_bytes:
            for i in rng.permutation(len(pool)):
                line = json.dumps({"id": count, "text": pool[i]}) + "\n"
                f.write(line)
                written += len(line)
                count += 1
                if written >= size_bytes:
                    break
    return count


def train_tokenizer(corpus: Path, out: Path, vocab_size: int, sample_bytes: int = 16 << 20) -> Path:
    """A byte-level BPE trained on the first ``sample_bytes`` of ``corpus``, BOS template, ``<|end_of_text|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts, size = [], 0
    with open(corpus) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size >= sample_bytes:
                break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))]
    )
    tok.save(str(out))
    return out


_RUN_PREPARE = """
import json, resource, sys, time
from lightning_4d.data.prepare import prepare_data_main
before = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
start = time.perf_counter()
code = prepare_data_main(sys.argv[1:])
seconds = time.perf_counter() - start
after = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
cpu = [a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before)]
kib = 1024 if sys.platform != "darwin" else 1
print(json.dumps({"code": code, "seconds": seconds, "cpu_self": cpu[0], "cpu_children": cpu[1],
                  "rss_self": after[0].ru_maxrss * kib, "rss_children": after[1].ru_maxrss * kib}))
"""

_RUN_BASELINE = """
import json, resource, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
encoded = seconds = cpu = size = 0.0
batch, batch_bytes = [], 0
def flush():
    global seconds, cpu, encoded, batch, batch_bytes
    start, start_cpu = time.perf_counter(), time.process_time()
    encoded += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=True))
    seconds += time.perf_counter() - start
    cpu += time.process_time() - start_cpu
    batch, batch_bytes = [], 0
with open(sys.argv[2], "rb") as f:
    for line in f:
        size += len(line)
        batch.append(json.loads(line)["text"])
        batch_bytes += len(line)
        if batch_bytes >= 1 << 20:
            flush()
flush()
print(json.dumps({"seconds": seconds, "cpu": cpu, "bytes": size, "tokens": encoded}))
"""


def run_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    argv = ["--input", str(corpus), "--output", str(out), "--tokenizer", str(tokenizer)]
    argv += ["--workers", str(workers), "--overwrite", "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_PREPARE, *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"code": proc.returncode}
    if result["code"] != 0:
        raise SystemExit(f"prepare-data failed:\n{proc.stderr[-3000:]}")
    result["summary"] = lines[-2]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="corpus size in GB (1e9 bytes; default 2)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run (default 1 2)")
    parser.add_argument("--vocab-size", type=int, default=32_000)
    parser.add_argument("--dir", type=Path, help="working folder (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        start = time.perf_counter()
        records = write_corpus(corpus, int(args.size_gb * 1e9))
        size = corpus.stat().st_size
        print(f"corpus: {size / 1e9:.2f} GB, {records:,} records ({time.perf_counter() - start:.0f} s to write)")
        start = time.perf_counter()
        tokenizer = train_tokenizer(corpus, tmp / "tokenizer.json", args.vocab_size)
        print(f"tokenizer: byte-level BPE, vocab {args.vocab_size:,} ({time.perf_counter() - start:.0f} s to train)")
        proc = subprocess.run(
            [sys.executable, "-c", _RUN_BASELINE, str(tokenizer), str(corpus)],
            env={**os.environ, **SINGLE_THREAD},
            capture_output=True,
            text=True,
            check=True,
        )
        base = json.loads(proc.stdout)
        base_rate = base["bytes"] / 1e6 / base["seconds"]
        tokens_per_second = base["tokens"] / base["seconds"]
        base_cpu_rate = base["bytes"] / 1e6 / base["cpu"]
        print(
            f"tokenizers encode_batch, 1 thread: {base_rate:.2f} MB/s ({tokens_per_second:,.0f} tokens/s), "
            f"{base_cpu_rate:.2f} MB per CPU-second",
            flush=True,
        )
        print(
            "| workers | seconds | MB/s | MB/s per worker | encode_batch / per worker | MB per CPU-s (main + workers) "
            "| encode_batch / that | peak RSS main | largest worker |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for workers in args.workers:
            r = run_prepare(corpus, tokenizer, tmp / "out.bin", workers)
            rate = size / 1e6 / r["seconds"]
            cpu_rate = size / 1e6 / (r["cpu_self"] + r["cpu_children"])
            print(
                f"| {workers} | {r['seconds']:.1f} | {rate:.2f} | {rate / workers:.2f} | "
                f"{base_rate / (rate / workers):.2f}x | {cpu_rate:.2f} | {base_cpu_rate / cpu_rate:.2f}x | "
                f"{r['rss_self'] / 2**20:,.0f} MiB | {r['rss_children'] / 2**20:,.0f} MiB |",
                flush=True,
            )
        print(r["summary"])


if __name__ == "__main__":
    main()
