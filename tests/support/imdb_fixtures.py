"""Small generated IMDb-format data: aclImdb/{train,test}/{pos,neg}/{id}_{rating}.txt, as folder and tar."""
from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np

POSITIVE = ["great", "wonderful", "superb", "loved", "brilliant", "moving"]
NEGATIVE = ["awful", "terrible", "boring", "hated", "worst", "dull"]
FILLER = ["the", "movie", "plot", "actor", "scene", "was", "and", "a", "film", "story", "really", "it"]


def review(rng: np.random.Generator, positive: bool) -> str:
    words = list(rng.choice(FILLER, size=int(rng.integers(12, 30))))
    for word in rng.choice(POSITIVE if positive else NEGATIVE, size=int(rng.integers(2, 5))):
        words.insert(int(rng.integers(0, len(words))), str(word))
    half = len(words) // 2
    return " ".join(words[:half]) + ".<br /><br />" + " ".join(words[half:]) + "!"


def make_aclimdb(root: Path, per_label: int, test_per_label: int = 0, bad_files: bool = True,
                 seed: int = 0) -> Path:
    """Write `root/aclImdb/...` with the official `<split>/urls_<label>.txt` (review i of each label is of movie
    `movie_of(i)`: 2 positive and 2 negative reviews per movie); with bad_files, add one malformed name, one
    non-UTF-8 and one empty review to train/pos and a README outside the layout. Returns the `aclImdb` folder's
    parent."""
    rng = np.random.default_rng(seed)
    splits = {"train": per_label, "test": test_per_label}
    for split, count in splits.items():
        for label in ("pos", "neg"):
            if count == 0:
                continue
            folder = root / "aclImdb" / split / label
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                rating = int(rng.integers(7, 11)) if label == "pos" else int(rng.integers(1, 5))
                (folder / f"{i}_{rating}.txt").write_text(review(rng, label == "pos"), encoding="utf-8")
            urls = [f"http://www.imdb.com/title/{movie_of(i)}/usercomments" for i in range(count)]
            (folder.parent / f"urls_{label}.txt").write_text("\n".join(urls) + "\n")
    if bad_files:
        pos = root / "aclImdb" / "train" / "pos"
        (pos / "notes.txt").write_text("not a review name")
        (pos / f"{per_label}_9.txt").write_bytes(b"caf\xe9 latin-1 bytes")
        (pos / f"{per_label + 1}_8.txt").write_text("  <br />  ")
        (root / "aclImdb" / "README").write_text("not a review")
    return root


def fixed_tokenizer(root: Path, path: Path) -> Path:
    """A WordPiece tokenizer at `path` whose vocabulary is every word of the train reviews under `root`, whole:
    the same in every session. Trained on text this small and tie-heavy, WordPiece picks other sub-word pieces
    from process to process (pipelines/data/tokenize.py), and so the tiny model learnt other things."""
    from pipelines.data.tokenize import wordpiece_tokenizer

    words = wordpiece_tokenizer([])  # its normaliser and pre-tokeniser
    texts = (review.read_text(encoding="utf-8") for review in sorted((root / "aclImdb" / "train").glob("*/*.txt")))
    tokens = {word for text in texts for word, _ in
              words.pre_tokenizer.pre_tokenize_str(words.normalizer.normalize_str(text))}
    wordpiece_tokenizer(tokens).save(str(path))
    return path


def movie_of(review_id: int) -> str:
    return f"tt{review_id // 2:07d}"


def tar_of(folder_root: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder_root / "aclImdb", arcname="aclImdb")
    return archive
