"""Prompt text for the workloads, built from the model's own tokenizer.

Every piece of text is a slice of one token stream (the Python standard
library's sources), decoded back to text: its length in tokens is known up to
boundary effects, and distinct slices give distinct prefixes, so a prefix hit
happens only where the workload means one (shared system prompt, a user's own
growing history, a returning document).
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

_SOURCES = [
    "typing.py",
    "inspect.py",
    "argparse.py",
    "difflib.py",
    "pathlib.py",
    "functools.py",
    "textwrap.py",
    "statistics.py",
    "zipfile.py",
    "tarfile.py",
    "pydoc.py",
    "doctest.py",
    "subprocess.py",
    "threading.py",
    "configparser.py",
    "shutil.py",
    "tempfile.py",
    "ast.py",
    "dataclasses.py",
    "enum.py",
]


class TextSource:
    """Hands out non-overlapping slices of a long token stream as text."""

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        text = "\n".join(
            (stdlib / name).read_text(errors="replace")
            for name in _SOURCES
            if (stdlib / name).exists()
        )
        self.ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.pos = random.Random(seed).randrange(0, max(1, len(self.ids) // 8))

    def take(self, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        if self.pos + num_tokens > len(self.ids):
            self.pos = 0  # wrap: still distinct in practice through the tags below
        ids = self.ids[self.pos : self.pos + num_tokens]
        self.pos += num_tokens
        return self.tokenizer.decode(ids)


@dataclass
class User:
    user_id: int
    history: str  # system prompt + this user's history + earlier rounds
    rounds_done: int = 0
    questions: list[str] = field(default_factory=list)


class MultiRoundQA:
    """LMBenchmark's synthetic-multi-round-qa: users share a system prompt,
    each has its own history, and every round appends a question and the
    model's answer to that user's conversation."""

    def __init__(
        self,
        source: TextSource,
        num_users: int,
        num_rounds: int,
        system_prompt_tokens: int,
        user_history_tokens: int,
        answer_tokens: int,
        question_tokens: int = 16,
    ):
        self.num_users, self.num_rounds = num_users, num_rounds
        self.answer_tokens = answer_tokens
        system = "System: " + source.take(system_prompt_tokens)
        self.users = []
        for uid in range(num_users):
            history = f"{system}\nUser {uid} history: {source.take(user_history_tokens)}"
            questions = [
                f"\nUser {uid} question {r}: {source.take(question_tokens)}\nAnswer:"
                for r in range(num_rounds)
            ]
            self.users.append(User(uid, history, 0, questions))

    @property
    def total_requests(self) -> int:
        return self.num_users * self.num_rounds

    def prompt(self, user: User) -> str:
        return user.history + user.questions[user.rounds_done]

    def record_answer(self, user: User, answer: str) -> None:
        user.history = self.prompt(user) + answer
        user.rounds_done += 1


@dataclass
class DocRequest:
    doc_id: int
    pass_index: int
    prompt: str


def long_doc_qa(
    source: TextSource,
    num_documents: int,
    document_tokens: int,
    repeat_count: int,
    hit_ratio: float,
    seed: int = 0,
) -> list[DocRequest]:
    """Long document QA: a first pass over ``num_documents`` documents (all
    misses), then ``repeat_count`` passes of as many requests, each a document
    seen before with probability ``hit_ratio`` and a new one otherwise."""
    rng = random.Random(seed)
    docs: list[str] = []

    def new_doc() -> int:
        docs.append(f"Document {len(docs)}:\n" + source.take(document_tokens))
        return len(docs) - 1

    question = "\nQuestion: summarize the document above.\nAnswer:"
    order = [(new_doc(), 0) for _ in range(num_documents)]
    for p in range(1, repeat_count + 1):
        for _ in range(num_documents):
            seen = len(docs)
            order.append((rng.randrange(seen) if rng.random() < hit_ratio else new_doc(), p))
    return [DocRequest(d, p, docs[d] + question) for d, p in order]
