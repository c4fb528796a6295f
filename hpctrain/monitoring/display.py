"""What rank 0 shows while training: a tqdm bar on a terminal, plain lines in a batch job. ``progress`` is
``"auto"`` (a bar when stderr is a terminal, else lines), ``"bar"``, ``"log"`` or ``"off"``. Only rank 0
builds a :class:`ProgressDisplay`; the other ranks stay quiet. Warnings (slow ranks, diverged parameters) go
through :meth:`ProgressDisplay.message`, so they do not tear the bar apart. A log line in a batch job::

    step 200/1000 epoch 1 loss 0.4312 lr 1.00e-03 5120.3 samples/s 0.050 s/step ETA 0:00:40
"""
import datetime
import sys
import time


def resolve_mode(mode, stream=None):
    """``auto`` becomes ``bar`` on a terminal and ``log`` otherwise (a Slurm output file)."""
    stream = sys.stderr if stream is None else stream
    if mode != "auto":
        return mode
    try:
        return "bar" if stream.isatty() else "log"
    except (AttributeError, ValueError):  # closed or not a real file
        return "log"


def format_eta(seconds):
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    return str(datetime.timedelta(seconds=int(round(seconds))))


def format_line(step, total, epoch, loss=None, lr=None, samples_per_s=None, step_time=None, eta=None,
                memory_mib=None):
    """The plain progress line (pure); ``memory_mib``: the highest peak resident memory of any rank."""
    parts = [f"step {step}" + (f"/{total}" if total else ""), f"epoch {epoch}"]
    shown = ((loss, "loss {:.4f}"), (lr, "lr {:.2e}"), (samples_per_s, "{:.1f} samples/s"),
             (step_time, "{:.3f} s/step"), (memory_mib, "peak mem {:.0f} MiB/rank"))
    parts += [form.format(value) for value, form in shown if value is not None]
    if total:
        parts.append(f"ETA {format_eta(eta)}")
    return " ".join(parts)


class ProgressDisplay:
    """Rank 0's view: ``step()`` every step, ``interval()`` every ``log_every`` steps with their averages."""

    def __init__(self, mode="auto", total_steps=None, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.mode = resolve_mode(mode, self.stream)
        self.total = total_steps or None
        self.bar = None
        self._postfix_time = 0.0

    def step(self, step, epoch, loss=None):
        """Every step: advance the bar (the bar throttles its own redraws)."""
        if self.mode != "bar":
            return
        if self.bar is None:
            from tqdm import tqdm

            # initial: a resumed run starts its bar where it left off
            self.bar = tqdm(total=self.total, initial=max(0, step - 1), file=self.stream, unit="step",
                            dynamic_ncols=True, smoothing=0.1)
        self.bar.update(step - self.bar.n)
        now = time.monotonic()
        # postfix at most once a second: reading a GPU loss waits for the GPU
        if now - self._postfix_time >= 1.0:
            self._postfix_time = now
            postfix = {"epoch": epoch}
            if loss is not None:
                postfix["loss"] = f"{float(loss):.4f}"
            self.bar.set_postfix(postfix, refresh=False)

    def interval(self, step, epoch, loss=None, lr=None, samples_per_s=None, step_time=None, memory_mib=None):
        """Every ``log_every`` steps: a line in batch mode, throughput in the bar's postfix."""
        eta = (self.total - step) * step_time if self.total and step_time else None
        if self.mode == "log":
            self._write(format_line(step, self.total, epoch, loss, lr, samples_per_s, step_time, eta, memory_mib))
        elif self.mode == "bar" and self.bar is not None:
            shown = (("loss", loss, "{:.4f}"), ("samples/s", samples_per_s, "{:.1f}"), ("mem", memory_mib, "{:.0f}MiB"))
            self.bar.set_postfix({"epoch": epoch, **{k: form.format(v) for k, v, form in shown if v is not None}})

    def message(self, text):
        """A line that must be seen whatever the mode (warnings), even with ``off``."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self._write(text)

    def _write(self, text):
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
