"""Reward functions for test_pool.py, in a module without heavy imports: process-pool workers
import it by name, so they start fast."""

import os
import time


def exact_match(text, answer):
    """Correct iff the text is the answer; also a 'hang', 'spin', 'raise', 'exit' switchboard."""
    if text == "hang":
        time.sleep(120)
    if text == "spin":
        while True:  # a CPU-bound hang: only killing the process stops it
            pass
    if text == "raise":
        raise ValueError("bad response")
    if text == "exit":
        os._exit(3)
    if text == "string":
        return "yes"
    if text == "shaped":
        return {"reward": 0.25, "outcome": False, "length": 6.0}
    return text == answer


def sleepy(text, answer):
    time.sleep(0.4)
    return 1.0


def decode_until_zero(ids):
    """A stand-in detokenizer: digits, stopping at id 0 (an eos)."""
    out = []
    for i in ids:
        if i == 0:
            break
        out.append(str(i))
    return "".join(out)


def always_fails(text, answer):
    """A reward function broken for every response (the run must stop, not train on zeros)."""
    raise RuntimeError("the reward service is down")


class SlowToLoad:
    """A reward whose scorer takes `load_s` to load on first use (like an import), then is
    instant; `warmup()` loads it before the worker takes work unless `warm` is False."""

    def __init__(self, load_s: float, warm: bool = True, fail_warmup: bool = False):
        self.load_s, self.warm, self.fail_warmup = load_s, warm, fail_warmup
        self.loaded = False
        if not warm:
            self.warmup = None  # no warmup: the pool must not find one

    def _load(self):
        if not self.loaded:
            time.sleep(self.load_s)
            self.loaded = True

    def warmup(self):
        if self.fail_warmup:
            raise OSError("scorer file missing")
        self._load()

    def __call__(self, text, answer):
        self._load()
        return text == answer
