"""Prometheus text exposition of what the server did (no client library needed for
a handful of counters)."""

import threading
from collections import Counter


class Metrics:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._lock = threading.Lock()
        self.requests = Counter()  # status -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cycles = 0
        self.draft_cycles = 0
        self.lookup_cycles = 0
        self.suffix_cycles = 0
        self.grammar_cycles = 0
        self.committed = Counter()  # tokens committed per cycle -> cycles
        self.last_tps = 0.0
        self.prefix_cache_hits = 0
        self.prefix_cache_bytes = 0
        self.prefix_cache_entries = 0
        self.batch_steps = Counter()  # (batch size, "plain" | "draft" | "apart") -> steps
        self.batch_size = 0  # rows in the last batch step

    def finished(self, last, cancelled: bool = False) -> None:
        with self._lock:
            self.requests["cancelled" if cancelled else "200"] += 1
            self.prompt_tokens += last.prompt_tokens
            self.generated_tokens += last.generation_tokens
            self.cycles += len(last.widths)
            self.draft_cycles += last.sources.count("dflash")
            self.lookup_cycles += last.sources.count("lookup")
            self.suffix_cycles += last.sources.count("suffix")
            self.grammar_cycles += last.sources.count("grammar")
            for k, n in enumerate(last.acceptance_histogram, start=1):
                self.committed[k] += n
            self.last_tps = last.generation_tps

    def batch_step(self, size: int, width: int, passes: int = 1) -> None:
        if not size:  # a prefill's step: nothing decoded
            return
        with self._lock:
            self.batch_steps[size, "apart" if passes > 1 else "draft" if width > 1 else "plain"] += 1
            self.batch_size = size

    def rejected(self, status: int) -> None:
        with self._lock:
            self.requests[str(status)] += 1

    def render(self, queue_depth: int) -> str:
        with self._lock:
            committed_total = sum(k * n for k, n in self.committed.items())
            cycles = sum(self.committed.values())
            lines = [
                "# HELP dflash_requests_total Requests by outcome (HTTP status, or cancelled by the client).",
                "# TYPE dflash_requests_total counter",
                *(f'dflash_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())),
                "# TYPE dflash_prompt_tokens_total counter",
                f"dflash_prompt_tokens_total {self.prompt_tokens}",
                "# TYPE dflash_generated_tokens_total counter",
                f"dflash_generated_tokens_total {self.generated_tokens}",
                "# HELP dflash_tau Mean tokens committed per target pass, over all requests.",
                "# TYPE dflash_tau gauge",
                f"dflash_tau {committed_total / cycles if cycles else 0:.4f}",
                "# HELP dflash_cycles_total Decode cycles, those the drafter proposed, those the prompt "
                "lookup proposed, those copied from earlier answers and those a grammar forced (the rest "
                "decoded plainly).",
                "# TYPE dflash_cycles_total counter",
                f'dflash_cycles_total{{kind="all"}} {self.cycles}',
                f'dflash_cycles_total{{kind="draft"}} {self.draft_cycles}',
                f'dflash_cycles_total{{kind="lookup"}} {self.lookup_cycles}',
                f'dflash_cycles_total{{kind="suffix"}} {self.suffix_cycles}',
                f'dflash_cycles_total{{kind="grammar"}} {self.grammar_cycles}',
                "# HELP dflash_committed_tokens Cycles by tokens committed (histogram, le = tokens).",
                "# TYPE dflash_committed_tokens histogram",
            ]
            running = 0
            for k in range(1, self.block_size + 1):
                running += self.committed.get(k, 0)
                lines.append(f'dflash_committed_tokens_bucket{{le="{k}"}} {running}')
            lines += [
                f'dflash_committed_tokens_bucket{{le="+Inf"}} {running}',
                f"dflash_committed_tokens_sum {committed_total}",
                f"dflash_committed_tokens_count {cycles}",
                "# TYPE dflash_generation_tokens_per_second gauge",
                f"dflash_generation_tokens_per_second {self.last_tps:.3f}",
                "# TYPE dflash_queue_depth gauge",
                f"dflash_queue_depth {queue_depth}",
                "# TYPE dflash_prefix_cache_hits_total counter",
                f"dflash_prefix_cache_hits_total {self.prefix_cache_hits}",
                "# HELP dflash_prefix_cache_bytes Bytes of states the prompt cache holds in memory.",
                "# TYPE dflash_prefix_cache_bytes gauge",
                f"dflash_prefix_cache_bytes {self.prefix_cache_bytes}",
                "# HELP dflash_prefix_cache_entries Prompt states the prompt cache holds in memory.",
                "# TYPE dflash_prefix_cache_entries gauge",
                f"dflash_prefix_cache_entries {self.prefix_cache_entries}",
                "# HELP dflash_batch_size Requests decoded together in the last batch step.",
                "# TYPE dflash_batch_size gauge",
                f"dflash_batch_size {self.batch_size}",
                "# HELP dflash_batch_steps_total Batch steps by batch size and mode (draft: a batched "
                "verify of drafted tokens; apart: the same in two passes, each part of the batch at its "
                "own width; plain: batched plain decoding).",
                "# TYPE dflash_batch_steps_total counter",
                *(
                    f'dflash_batch_steps_total{{size="{size}",mode="{mode}"}} {n}'
                    for (size, mode), n in sorted(self.batch_steps.items())
                ),
            ]
        return "\n".join(lines) + "\n"
