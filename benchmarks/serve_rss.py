"""Resident memory of ``selfspec serve`` over bursts of concurrent requests, per allocator setting.

    python benchmarks/serve_rss.py                          # 4 bursts of 50: unfixed, capped, default, trim-only
    python benchmarks/serve_rss.py --bursts 3 --burst 40 --settings unfixed default

Each setting starts its own ``python -m selfspec serve --model selfspec-demo --threads 1`` on
127.0.0.1, warms it up (two requests alone, then one burst that is not counted), then sends
``--bursts`` bursts of ``--burst`` concurrent short requests (text and chat, streamed and not)
and reads the server's ``VmRSS`` from ``/proc`` after each burst has finished and settled. The
settings run one after another on the same machine, interleaved round by round when ``--rounds``
is more than one; the load average is recorded with every burst.

Settings: ``unfixed`` (glibc's default arenas, no trim: the server before issue 44), ``capped``
(the server's own arena limit, ``ARENA_MAX``), ``default`` (as shipped: the limit and a
``malloc_trim(0)`` each time the server goes idle), ``trim-only`` (glibc's arenas, the trim), and a
few more (``--settings``). ``--settle`` must exceed the server's idle delay
(``selfspec.serving.server.allocator.IDLE_TRIM_DELAY``) for the trim to show.

Writes benchmarks/results/serve_rss_cpu.json, .md and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from selfspec.artifacts import atomic_path, atomic_write_text

MODEL = "selfspec-demo"
PROMPTS = [
    "It is a truth universally acknowledged",
    "The sea was calm that morning",
    "Once upon a time",
    "My dear Elizabeth",
    "The captain looked at the map",
    "In the garden there was",
]
NEW_TOKENS = 12
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Setting:
    """One way to start the server: extra environment variables and ``serve`` flags."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    note: str = ""


SETTINGS = {
    setting.name: setting
    for setting in [
        Setting(
            "unfixed",
            {"MALLOC_ARENA_MAX": "0", "SELFSPEC_IDLE_TRIM": "0"},
            note="glibc's default arenas (8 per core), no trim: the server before issue 44",
        ),
        Setting("capped", {"SELFSPEC_IDLE_TRIM": "0"}, note="ARENA_MAX arenas (the server sets them), no trim"),
        Setting("default", note="as shipped: ARENA_MAX arenas and malloc_trim(0) when the server goes idle"),
        Setting("trim-only", {"MALLOC_ARENA_MAX": "0"}, note="glibc's default arenas, malloc_trim(0) when idle"),
        Setting("arena-1-env", {"MALLOC_ARENA_MAX": "1"}, note="MALLOC_ARENA_MAX=1 in the environment, trim"),
        Setting("batching", flags=("--batching",), note="--batching, as shipped"),
        Setting(
            "batching-unfixed",
            {"MALLOC_ARENA_MAX": "0", "SELFSPEC_IDLE_TRIM": "0"},
            ("--batching",),
            note="--batching, glibc's default arenas, no trim",
        ),
        Setting(
            "pool-4", flags=("--max-concurrent", "4"), note="at most 4 generation requests at once (4 workers busy)"
        ),
    ]
}
#: What ``python benchmarks/serve_rss.py`` measures without ``--settings``.
DEFAULT_SETTINGS = ("unfixed", "capped", "default", "trim-only")


@dataclass
class Burst:
    """One burst's outcome."""

    rss_mb: float
    seconds: float
    statuses: dict[str, int]
    load: float


@dataclass
class Run:
    """One setting's run: RSS after start, after the warm-up, and after each burst."""

    setting: str
    start_rss_mb: float
    warm_rss_mb: float
    bursts: list[Burst]
    threads: int

    @property
    def growth_mb(self) -> list[float]:
        """RSS growth from one burst to the next (the first from the warm-up)."""
        previous = [self.warm_rss_mb] + [burst.rss_mb for burst in self.bursts[:-1]]
        return [round(burst.rss_mb - before, 1) for burst, before in zip(self.bursts, previous, strict=True)]


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (``VmRSS``, Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def thread_count(pid: int) -> int:
    """Threads of process ``pid``."""
    return len(os.listdir(f"/proc/{pid}/task"))


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(setting: Setting, port: int) -> subprocess.Popen[str]:
    """Start ``selfspec serve`` with ``setting`` and return once it answers ``/health``."""
    command = [sys.executable, "-m", "selfspec", "serve", "--model", MODEL, "--port", str(port), "--threads", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **setting.env}
    for name in ("MALLOC_ARENA_MAX", "SELFSPEC_IDLE_TRIM"):
        if name not in setting.env:
            env.pop(name, None)
    process = subprocess.Popen(
        [*command, *setting.flags, "--log-level", "warning"], env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"selfspec serve did not start: {process.communicate()[1][-2000:]}")
        time.sleep(0.2)


#: The request mix, cycled through by index: like tests/system/test_load.py's, without the 413s.
KINDS = ("text", "chat", "text-stream", "chat-stream", "drop-stream", "drop-wait", "big-prompt", "long")
BIG_PROMPT = "x" * 1_900_000  # under the body limit, over the context window: 400 before tokenizing


async def one_request(client: httpx.AsyncClient, index: int) -> int:
    """One request of the mix (greedy); returns its status (0: the client left before the answer)."""
    kind = KINDS[index % len(KINDS)]
    chat, stream = kind.startswith("chat"), kind.endswith("stream")
    prompt = BIG_PROMPT if kind == "big-prompt" else PROMPTS[index % len(PROMPTS)]
    tokens = {"drop-stream": 400, "drop-wait": 400, "long": 64}.get(kind, NEW_TOKENS)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": tokens, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if kind == "drop-wait":  # a client that gives up before its answer
        try:
            return (await client.post(path, json=body, timeout=0.5 + index % 5 * 0.2)).status_code
        except httpx.TimeoutException:
            return 0
    if not stream:
        return (await client.post(path, json=body)).status_code
    async with client.stream("POST", path, json=body) as response:
        lines = 0
        async for _ in response.aiter_lines():
            lines += 1
            if kind == "drop-stream" and lines >= 6:  # leaves mid-stream
                break
        return response.status_code


async def burst(root: str, count: int) -> dict[str, int]:
    """``count`` concurrent requests; returns how many got each status."""
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=root, timeout=300, limits=limits) as client:
        statuses = await asyncio.gather(*(one_request(client, i) for i in range(count)))
    counts: dict[str, int] = {}
    for status in statuses:
        counts[str(status)] = counts.get(str(status), 0) + 1
    return counts


def measure(setting: Setting, bursts: int, size: int, settle: float) -> Run:
    """Start a server with ``setting``, warm it up, and read its RSS after each of ``bursts`` bursts."""
    port = free_port()
    process = start_server(setting, port)
    root = f"http://127.0.0.1:{port}"
    try:
        start = rss_mb(process.pid)
        asyncio.run(burst(root, 1))  # one request alone, then a burst that allocates the caches
        asyncio.run(burst(root, size))  # not counted
        time.sleep(settle)
        warm = rss_mb(process.pid)
        results = []
        for _ in range(bursts):
            started = time.monotonic()
            statuses = asyncio.run(burst(root, size))
            seconds = time.monotonic() - started
            time.sleep(settle)
            results.append(Burst(round(rss_mb(process.pid), 1), round(seconds, 2), statuses, os.getloadavg()[0]))
            print(f"  {setting.name}: burst {len(results)}: RSS {results[-1].rss_mb:.0f} MB, {seconds:.1f} s, "
                  f"{statuses}, load {results[-1].load:.1f}", file=sys.stderr, flush=True)  # fmt: skip
        return Run(setting.name, round(start, 1), round(warm, 1), results, thread_count(process.pid))
    finally:
        process.terminate()
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def report(runs: list[Run], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON report: every run, and per setting the median growth per burst."""
    summary = {}
    for name in dict.fromkeys(run.setting for run in runs):
        growths = [growth for run in runs if run.setting == name for growth in run.growth_mb]
        finals = [run.bursts[-1].rss_mb for run in runs if run.setting == name]
        summary[name] = {
            "median_growth_per_burst_mb": round(statistics.median(growths), 1),
            "max_growth_per_burst_mb": max(growths),
            "final_rss_mb": finals,
            "note": SETTINGS[name].note,
        }
    return {
        "what": f"selfspec serve --model {MODEL} --threads 1: RSS after each burst of {args.burst} concurrent "
        f"requests (greedy; a mix of {', '.join(KINDS)}), after a warm-up burst",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "libc": platform.libc_ver()},
        "bursts": args.bursts,
        "burst_size": args.burst,
        "settle_s": args.settle,
        "summary": summary,
        "runs": [{**asdict(run), "growth_mb": run.growth_mb} for run in runs],
    }


def markdown(result: dict[str, Any]) -> str:
    """A table of RSS per burst for each setting."""
    lines = [
        "# selfspec serve: resident memory over bursts",
        "",
        result["what"] + f"; {result['machine']['cpus']} CPUs, shared, load average recorded per burst.",
        "",
        "| setting | start | after warm-up | after each burst (MB) | growth per burst (MB) | load | threads |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        rss = ", ".join(f"{burst['rss_mb']:.0f}" for burst in run["bursts"])
        growth = ", ".join(f"{growth:+.0f}" for growth in run["growth_mb"])
        loads = ", ".join(f"{burst['load']:.1f}" for burst in run["bursts"])
        lines.append(
            f"| {run['setting']} | {run['start_rss_mb']:.0f} | {run['warm_rss_mb']:.0f} | {rss} | {growth} | {loads} "
            f"| {run['threads']} |"
        )
    lines += ["", "| setting | median growth per burst | largest | what it is |", "|---|---|---|---|"]
    for name, row in result["summary"].items():
        lines.append(
            f"| {name} | {row['median_growth_per_burst_mb']:+.1f} MB | {row['max_growth_per_burst_mb']:+.1f} MB "
            f"| {row['note']} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    """RSS after the warm-up and after each burst, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for run in result["runs"]:
        values = [run["warm_rss_mb"]] + [burst["rss_mb"] for burst in run["bursts"]]
        ax.plot(range(len(values)), values, marker="o", label=run["setting"])
    ax.set_xticks(range(result["bursts"] + 1), ["warm"] + [str(i + 1) for i in range(result["bursts"])])
    ax.set_xlabel("after burst")
    ax.set_ylabel("server RSS (MB)")
    ax.set_title(f"selfspec serve, demo model, 1 thread: bursts of {result['burst_size']}")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as partial:
        fig.savefig(partial, dpi=120, format="png")
    plt.close(fig)


def main() -> None:
    """Measure every setting asked for and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--burst", type=int, default=50, help="concurrent requests per burst")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds to wait after a burst before reading RSS")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each setting, interleaved")
    parser.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", default=str(RESULTS / "serve_rss_cpu"), help="report path without extension")
    args = parser.parse_args()
    runs = []
    for _ in range(args.rounds):
        for name in args.settings:
            runs.append(measure(SETTINGS[name], args.bursts, args.burst, args.settle))
    result = report(runs, args)
    atomic_write_text(f"{args.out}.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(f"{args.out}.md", markdown(result))
    plot(result, f"{args.out}.png")
    sys.stdout.write(markdown(result))


if __name__ == "__main__":
    main()
