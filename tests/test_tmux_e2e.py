"""`dflash-cli chat` end to end in a real terminal: a detached tmux session of a fixed size."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import MASK_ID, drafter_config, save_target, save_tiny_tokenizer, target_config

from dflash_cli.conversation import Conversation, GenerationSettings
from dflash_cli.engine.drafter import DFlashDrafter, DrafterConfig
from dflash_cli.engine.load import save_drafter
from dflash_cli.runtime.local import load_runtime

pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None,
    reason="tmux is not installed (apt-get install -y tmux): the real-terminal chat test needs it")

PROMPT = "Hello there"
MAX_TOKENS = 40
# fixed blocks of the drafter's trained size: these tests are about what the terminal shows of accepted drafts,
# not about when the adaptive controller drafts (on a 40-token reply it may pause a drafter whose probes cost
# several plain rounds, as this tiny pair's do, and not probe again before the reply ends)
BLOCK = 8
EDITED = "Written in the editor"
PRINTABLE = range(4, 99)  # the tiny tokenizer's ids of " " .. "~"
CYAN_TEXT = re.compile(r"\x1b\[(?:[0-9;]*;)?36m([^\x1b]*)")  # text in the colour of accepted drafts


def constant_drafter(folder: Path, cfg: dict, target, token: int) -> Path:
    """A drafter that always proposes `token`: its layers add nothing (zero output projections), so its
    final hidden state is the mask token's embedding, and its final norm maps that onto `token`'s row of
    the target's lm_head. Where the target repeats `token`, the drafts are accepted."""
    torch.manual_seed(2)
    drafter = DFlashDrafter(DrafterConfig.from_dict(drafter_config(cfg)))
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        e = target.embed_weight[MASK_ID].float()
        n = e * torch.rsqrt(e.pow(2).mean() + 1e-6)
        n = torch.where(n.abs() < 1e-3, torch.full_like(n, 1e-3).copysign(n), n)
        drafter.norm.weight.copy_(target.lm_head.weight[token].float() * 4 / n)
    return save_drafter(drafter, folder)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Tiny target + a drafter it partly agrees with, and the reply the chat must print."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only lose time on a busy machine
    root = tmp_path_factory.mktemp("tmux-models")
    cfg = target_config()
    target = save_target(root / "target", cfg, seed=1, scale=3.0)
    save_tiny_tokenizer(target)
    settings = GenerationSettings(max_tokens=MAX_TOKENS)
    plain = load_runtime(str(target), None, dtype="float32", device="cpu")
    conv = Conversation(plain)
    tokens = [t for step in conv.ask(PROMPT, settings) for t in step.tokens]
    plain_reply = conv.messages[-1]["content"]
    repeated, count = Counter(t for t in tokens if t in PRINTABLE).most_common(1)[0]
    assert count >= 4, f"the tiny target no longer repeats a character for {PROMPT!r}: {tokens}"
    drafter = constant_drafter(root / "drafter", cfg, plain.target, repeated)
    spec = load_runtime(str(target), str(drafter), dtype="float32", device="cpu")
    conv = Conversation(spec)
    steps = list(conv.ask(PROMPT, GenerationSettings(max_tokens=MAX_TOKENS, block_size=BLOCK)))
    assert sum(s.accepted for s in steps) > 0, "the constant drafter should be accepted where the target repeats"
    assert conv.messages[-1]["content"] == plain_reply  # lossless: the drafter changes nothing but speed
    torch.set_num_threads(threads)
    return target, drafter, plain_reply, len(tokens), plain.tokenizer.decode([repeated])


def summaries(pane: str) -> int:
    """Summary lines after replies ("40 tokens · 123.4 tok/s · ..."), not the live status line."""
    return sum(" tokens · " in line and "tok/s" in line for line in pane.splitlines())


class Tmux:
    """A private tmux server (its own socket, no user config) holding one session."""

    def __init__(self):
        self.base = ["tmux", "-L", f"dflash-test-{uuid.uuid4().hex[:8]}", "-f", "/dev/null"]

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], capture_output=True, text=True, check=True, timeout=30).stdout

    def capture(self, escapes: bool = False) -> str:
        return self("capture-pane", "-p", "-J", "-S", "-", "-t", "chat", *(["-e"] if escapes else []))

    def wait_for(self, what: str, condition, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pane = self.capture()
            if condition(pane):
                return pane
            time.sleep(0.2)
        pytest.fail(f"timed out waiting for {what}; the pane shows:\n{self.capture()}")

    def kill(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=30)


def test_chat_in_a_real_terminal(pair, tmp_path):
    target, drafter, reply, n_tokens, repeated = pair
    exe = Path(sys.executable).with_name("dflash-cli")
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "dflash_cli"]
    args = [*cli, "chat", "-m", str(target), "--draft", str(drafter), "--dtype", "float32", "--device", "cpu",
            "--no-history", "-n", str(MAX_TOKENS), "--block-size", str(BLOCK)]
    exit_file = tmp_path / "exit-code"
    editor = tmp_path / "editor.sh"  # stands in for $EDITOR: writes the message into the file it is given
    editor.write_text(f"#!/bin/sh\nprintf '%s' {shlex.quote(EDITED)} > \"$1\"\n")
    editor.chmod(0o755)
    script = (f"env -u NO_COLOR -u DFLASH_COLOR -u VISUAL EDITOR={shlex.quote(str(editor))} TERM=xterm-256color "
              f"OMP_NUM_THREADS=1 {shlex.join(args)}; "
              f"code=$?; echo $code > {shlex.quote(str(exit_file))}; exit $code")
    tmux = Tmux()
    try:
        tmux("new-session", "-d", "-s", "chat", "-x", "100", "-y", "30", "sh", "-c", script,
             ";", "set-option", "-t", "chat", "remain-on-exit", "on")
        tmux.wait_for("the prompt", lambda pane: ">>> " in pane)
        tmux("send-keys", "-t", "chat", "-l", PROMPT)
        tmux("send-keys", "-t", "chat", "Enter")
        pane = tmux.wait_for("the reply, its summary line and the next prompt",
                             lambda pane: summaries(pane) == 1 and pane.count(">>> ") >= 2)
        assert reply in pane
        summary = next(line for line in pane.splitlines() if "tok/s" in line)
        assert summary.startswith(f"{n_tokens} tokens · ") and "draft acceptance" in summary
        colored = tmux.capture(escapes=True)
        drafted = CYAN_TEXT.findall(colored.split(PROMPT, 1)[1])  # cyan runs after the prompt line
        assert drafted and set("".join(drafted)) == {repeated}  # accepted drafts, and only they, are cyan
        tmux("send-keys", "-t", "chat", "-l", "/edit")  # opens $EDITOR, then sends what it wrote
        tmux("send-keys", "-t", "chat", "Enter")
        pane = tmux.wait_for("the reply to the edited message",
                             lambda pane: summaries(pane) == 2 and pane.count(">>> ") >= 4)
        assert f">>> {EDITED}" in pane
        tmux("send-keys", "-t", "chat", "-l", "/bye")
        tmux("send-keys", "-t", "chat", "Enter")
        deadline = time.monotonic() + 30  # the shell around the chat writes its exit status, then the pane dies
        while tmux("display-message", "-p", "-t", "chat", "#{pane_dead}").strip() != "1":
            assert time.monotonic() < deadline, f"chat did not exit after /bye:\n{tmux.capture()}"
            time.sleep(0.2)
        assert exit_file.read_text().strip() == "0"
    finally:
        tmux.kill()


AFTER_EXIT = ('echo "exit=$?"; stty -a | tr " " "\\n" | grep -x -- "-\\{0,1\\}icanon"; '
              'i=0; while [ $i -lt 40 ]; do i=$((i+1)); echo "line $i"; done; printf END')


@pytest.mark.parametrize("when", ["at the prompt", "during a reply"])
def test_sigterm_stops_the_chat_and_restores_the_terminal(pair, tmp_path, when, smollm2_converted, monkeypatch):
    """SIGTERM acts like Ctrl-C then exits 143: the partial reply ends with "interrupted", the status line
    is gone, the tty is back in canonical mode and the scroll region spans the whole screen again (the
    lines printed after the chat scroll down to the last row). During a reply: the demo model, whose
    replies are long and slow enough on a CPU to be caught in the middle."""
    target, drafter, *_ = pair
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(smollm2_converted.cache))  # reuse this run's conversion
    exe = Path(sys.executable).with_name("dflash-cli")
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "dflash_cli"]
    model = ["-m", "demo", "--temperature", "1", "--seed", "1", "-n", "3000"] if when == "during a reply" else \
        ["-m", str(target), "--draft", str(drafter), "--dtype", "float32"]
    args = [*cli, "chat", *model, "--device", "cpu", "--no-history"]
    pid_file = tmp_path / "pid"
    chat = f"echo $$ > {shlex.quote(str(pid_file))}; exec env TERM=xterm-256color OMP_NUM_THREADS=1 {shlex.join(args)}"
    script = f"sh -c {shlex.quote(chat)}; {AFTER_EXIT}; sleep 60"
    tmux = Tmux()
    try:
        tmux("new-session", "-d", "-s", "chat", "-x", "100", "-y", "30", "sh", "-c", script)
        tmux.wait_for("the prompt", lambda pane: ">>> " in pane)
        if when == "during a reply":
            tmux("send-keys", "-t", "chat", "-l", "Tell me a long story")
            tmux("send-keys", "-t", "chat", "Enter")
            tmux.wait_for("the reply to start", lambda pane: "tok/s" in pane)  # the live status line
        subprocess.run(["kill", "-TERM", pid_file.read_text().strip()], check=True)
        history = tmux.wait_for("the shell after the chat", lambda pane: "END" in pane)
        assert "exit=143" in history and "\nicanon\n" in history, history
        screen = tmux("capture-pane", "-p", "-t", "chat").split("\n")
        assert screen[29] == "END", history  # last row: no scroll region left
        assert "tok/s" not in history.split("exit=143")[0].rsplit("Tell me a long story", 1)[-1]
        if when == "during a reply":
            before_exit = history.split("exit=143")[0].rstrip("\n").splitlines()
            assert before_exit[-1] == "interrupted" and "Terminated" not in history
    finally:
        tmux.kill()
