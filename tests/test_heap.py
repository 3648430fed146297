"""engine/heap.py: the API server freezes its start-up heap out of the collector's scans.

Run in a fresh interpreter: freezing the test process would pin its garbage until exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_freeze_collects_then_freezes_and_unfreezes_at_exit():
    """Garbage is collected before the freeze; what a freeze pinned is freed by the next one
    (a process that builds several engines); the heap is unfrozen at exit."""
    script = textwrap.dedent("""
        import atexit, gc, weakref
        from specserve.engine.heap import freeze_startup_heap

        # registered first, so it runs last (atexit is LIFO): after the module's unfreeze
        atexit.register(lambda: print("at exit, frozen:", gc.get_freeze_count()))

        class Node:
            pass

        garbage = Node(); garbage.me = garbage  # a cycle that is already garbage
        gone = weakref.ref(garbage); del garbage
        live = [[i] for i in range(50000)]  # long-lived containers
        gc.collect(); before = len(gc.get_objects())
        frozen = freeze_startup_heap()
        pinned = Node(); pinned.me = pinned  # frozen live, then dropped (an old engine)
        was_pinned = weakref.ref(pinned)
        print(gone() is None, frozen >= 50000, len(gc.get_objects()) < before // 10)
        freeze_startup_heap(); del pinned
        print(was_pinned() is not None)  # frozen: no collection reaches it
        print(freeze_startup_heap() >= frozen - 10, was_pinned() is None)  # the next start frees it
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[:3] == ["True True True", "True", "True True"], done.stdout
    assert lines[3] == "at exit, frozen: 0", done.stdout  # unfrozen before the final collection


def test_offline_llm_does_not_freeze(tiny_llama):
    """Only the server freezes: an offline LLM must stay collectable (del llm; gc.collect()
    frees its model and KV cache), so building one freezes nothing."""
    script = textwrap.dedent(f"""
        import gc
        from specserve import LLM
        llm = LLM(model={str(tiny_llama)!r}, device="cpu")
        print(gc.get_freeze_count())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0", done.stdout
