"""`jax-moe <args>` in this process, for tests/test_cli_generate.py, which starts one per
process of a job; `--kill-at-step K --` before the arguments makes the process SIGKILL itself
right after launching its K-th decode step of the timed run (the launch is asynchronous, so
its peers are left waiting mid-exchange):

  python tests/cli_worker.py [--kill-at-step K --] generate --model ... --process-id 1 ...
"""

import os
import signal
import sys


def _kill_at_step(step: int) -> None:
  from jax_moe.models import generation

  init = generation.PromptGenerator.__init__

  def patched(self, *args, **kwargs):
    init(self, *args, **kwargs)
    launched = [0]
    step_fn = self._step

    def counting(*a, **k):
      out = step_fn(*a, **k)
      launched[0] += 1
      if launched[0] == step + 1:  # warmup() launches one step first
        os.kill(os.getpid(), signal.SIGKILL)
      return out

    self._step = counting

  generation.PromptGenerator.__init__ = patched


def main(argv):
  if argv[:1] == ["--kill-at-step"]:
    _kill_at_step(int(argv[1]))
    argv = argv[3:] if argv[2:3] == ["--"] else argv[2:]
  from jax_moe import cli

  return cli.main(argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
