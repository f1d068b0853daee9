"""Text for the causal-LM recipe: read once, tokenized once, cut into fixed windows.

    files = text_files("/data/train.jsonl")                # .txt, .jsonl, or a folder of them
    tokens = token_cache(files, tokenizer, cache_dir, ...)  # local rank 0 writes, others map it
    train, held_out = windows(tokens, seq_len=512, packing=True, eval_fraction=0.05)

Tokenizing on every rank repeats the same work N times and holds N copies of the ids. Here
local rank 0 of each node tokenizes and writes `tokens-<key>.npy` atomically (the key is
a hash of the files' names, sizes and mtimes, the tokenizer's files and the settings, so a
changed file or tokenizer makes a new cache); the other ranks wait for that file (bounded
by `wait_s`, then an error naming it) and map it read-only (`np.load(mmap_mode="r")`):
one copy in the page cache per node.

Windows are map-style samples, so the Trainer's sampler gives exact mid-epoch resume by
arithmetic on the batch counter (docs/your-model.md). Packing concatenates the documents,
each ended by the tokenizer's EOS, and cuts windows of `seq_len` tokens across document
boundaries (no padding, every token counts); without packing each document is cut on its
own and its last window is padded (labels -100, attention mask 0).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from disttrain.train.task import TaskError

TEXT_SUFFIXES = (".txt", ".jsonl")
IGNORE = -100   # labels the library's loss skips (padding)


def text_files(data: str | Path) -> list[Path]:
    """The text files `data` names: one .txt / .jsonl file, or every such file under a
    folder (sorted, so every rank and every run reads the same order).

    Raises:
        TaskError: the path is missing (the file and its folder named), of another kind,
            or a folder without text files.
    """
    path = Path(data)
    if not path.exists():
        folder = path.parent
        near = sorted(p.name for p in folder.iterdir())[:8] if folder.is_dir() else []
        raise TaskError(f"data: {path.name} is not in {folder}" +
                        (f" (it holds: {', '.join(near)})" if near else " (no such folder)"))
    if path.is_file():
        if path.suffix not in TEXT_SUFFIXES:
            raise TaskError(f"data: {path} is a {path.suffix or 'suffix-less'} file; give a .txt "
                            f"file, a .jsonl file with a text field, or a folder of them")
        return [path]
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not found:
        raise TaskError(f"data: no .txt or .jsonl file under {path}")
    return found


def documents(files: list[Path], text_field: str) -> Iterator[str]:
    """Each .txt file is one document; each line of a .jsonl file is one (its `text_field`).

    Raises:
        TaskError: a .jsonl line that is not JSON or lacks the field (file:line named).
    """
    for path in files:
        if path.suffix == ".txt":
            yield path.read_text(encoding="utf-8", errors="replace")
            continue
        with path.open(encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise TaskError(f"data: {path}:{n} is not JSON ({exc})") from None
                text = row.get(text_field) if isinstance(row, dict) else None
                if not isinstance(text, str):
                    keys = sorted(row)[:6] if isinstance(row, dict) else type(row).__name__
                    raise TaskError(f"data: {path}:{n} has no string field {text_field!r} "
                                    f"(it has {keys}); set task_args text_field")
                yield text


def cache_key(files: list[Path], tokenizer_files: list[Path], settings: dict[str, Any]) -> str:
    """A name for the token cache that changes when any input does."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for p in files:
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for p in tokenizer_files:
        h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:16]


def token_cache(files: list[Path], tokenizer: Any, cache_dir: Path, key: str, text_field: str,
                writer: bool, wait_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, document starts) from the cache, written first by the `writer` rank.

    Raises:
        TaskError: the cache did not appear within `wait_s` on a waiting rank, or cannot
            be written (the path named).
    """
    ids_path = cache_dir / f"tokens-{key}.npy"
    starts_path = cache_dir / f"tokens-{key}.starts.npy"
    if writer and not (ids_path.is_file() and starts_path.is_file()):
        ids, starts = _tokenize(documents(files, text_field), tokenizer)
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            _atomic_npy(starts_path, starts)
            _atomic_npy(ids_path, ids)   # last: its presence means both are complete
        except OSError as exc:
            raise TaskError(f"token cache: cannot write {ids_path} ({exc.strerror or exc}); set "
                            f"task_args cache_dir to a writable folder") from None
    deadline = time.monotonic() + wait_s
    while not ids_path.is_file():
        if time.monotonic() > deadline:
            raise TaskError(f"token cache: {ids_path} did not appear within {wait_s:.0f} s; local "
                            f"rank 0 writes it (is it alive? is cache_dir the same folder for all "
                            f"ranks of a node?)")
        time.sleep(0.2)
    return np.load(ids_path, mmap_mode="r"), np.load(starts_path)


def _tokenize(docs: Iterator[str], tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    eos = tokenizer.eos_token_id
    parts: list[np.ndarray] = []
    starts = [0]
    for text in docs:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids = [*ids, eos]
        parts.append(np.asarray(ids, dtype=np.int64))
        starts.append(starts[-1] + len(ids))
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max else np.int32
    ids = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
    return ids, np.asarray(starts, dtype=np.int64)


def _atomic_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


class TokenWindows(Dataset):
    """Fixed windows of a token array: {"input_ids", "labels", "attention_mask"} per sample.

    `spans` holds (start, length) per window; a window shorter than `seq_len` (the end of
    an unpacked document) is padded, its padding masked and ignored by the loss.
    """

    def __init__(self, ids: np.ndarray, spans: np.ndarray, seq_len: int, pad_id: int):
        self.ids, self.spans, self.seq_len, self.pad_id = ids, spans, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start, length = (int(v) for v in self.spans[i])
        window = torch.from_numpy(np.asarray(self.ids[start:start + length], dtype=np.int64))
        mask = torch.ones(self.seq_len, dtype=torch.long)
        if length < self.seq_len:
            pad = self.seq_len - length
            labels = torch.cat([window, torch.full((pad,), IGNORE, dtype=torch.long)])
            window = torch.cat([window, torch.full((pad,), self.pad_id, dtype=torch.long)])
            mask[length:] = 0
        else:
            labels = window
        return {"input_ids": window, "labels": labels, "attention_mask": mask}


def window_spans(n_tokens: int, starts: np.ndarray, seq_len: int, packing: bool) -> np.ndarray:
    """(start, length) of every window: across documents when packing (the tail that does
    not fill a window is dropped), else within each document (its tail padded; documents
    of one token, which teach nothing, are dropped)."""
    if packing:
        n = n_tokens // seq_len
        return np.stack([np.arange(n, dtype=np.int64) * seq_len,
                         np.full(n, seq_len, dtype=np.int64)], axis=1) if n else np.zeros((0, 2), np.int64)
    spans = []
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        for s in range(a, b, seq_len):
            length = min(seq_len, b - s)
            if length > 1:
                spans.append((s, length))
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


def split(spans: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Train and held-out windows: the last `eval_fraction` of them are held out (at least
    one when the fraction is above 0), so the split is the same on every rank and run."""
    if eval_fraction <= 0:
        return spans, spans[:0]
    n_eval = max(1, round(len(spans) * eval_fraction))
    if n_eval >= len(spans):
        raise TaskError(f"data: {len(spans)} window(s) of text, too few to hold out "
                        f"eval_fraction={eval_fraction}; give more text or a shorter seq_len")
    return spans[:-n_eval], spans[-n_eval:]
