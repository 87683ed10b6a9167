"""Open memsim's HTML report in a real headless browser: it loads without console errors and
shows its pictures and tables; a screenshot is saved.

The report is the one ``memsim analyze ... --html`` writes for the README's nanoGPT block. The
browser is the system's Chromium (Debian's ``chromium`` package, or Google Chrome), driven from
its command line: ``--dump-dom`` for what the page shows once loaded, ``--screenshot`` for the
picture, ``--enable-logging=stderr`` for the console. Where no such browser is installed the
check fails (exit 1), saying how to install one: a check that could not run has not passed.
``.ci/run`` installs Debian's ``chromium`` where no browser is found, then runs it after the
tests.

    python -m benchmarks.html_in_browser [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
            "chrome-headless-shell")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="where the report and screenshot go")
    args = ap.parse_args()
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        print("FAILED: the check could not run: no headless browser installed (looked for "
              + ", ".join(BROWSERS) + " on PATH); install one, e.g. on Debian or Ubuntu "
              "`apt-get install -y chromium`, and run it again", file=sys.stderr)
        return 1
    out = args.out or tempfile.mkdtemp(prefix="memsim-html-")
    os.makedirs(out, exist_ok=True)
    page = os.path.join(out, "report.html")
    from memsim.cli import main as memsim
    rc = memsim(["analyze", "examples/nanogpt_block.py:small", "--input", "x=float32[B,S,64]",
                 "--at", "B=2,S=8", "--train", "--gpu", "h100-80gb", "--html", page])
    if rc != 0:
        print(f"memsim analyze --html failed ({rc})")
        return 1
    url = "file://" + os.path.abspath(page)
    common = [browser, "--headless=new", "--disable-gpu", "--no-sandbox",
              "--window-size=1400,3000"]
    shot = os.path.join(out, "report.png")
    run = subprocess.run(common + ["--enable-logging=stderr", "--v=0", f"--screenshot={shot}",
                                   url], capture_output=True, text=True, timeout=120)
    console = [ln for ln in run.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    errors = [ln for ln in console if re.search(r"error|uncaught", ln, re.I)]
    dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    checks = {"pictures (svg)": dom.count("<svg") >= 2, "tables": "<table" in dom,
              "verdict": "FITS" in dom, "report text": "Exact formulas" in dom,
              "screenshot": os.path.exists(shot) and os.path.getsize(shot) > 10_000}
    for name, ok in checks.items():
        print(f"{name}: {'ok' if ok else 'MISSING'}")
    print(f"console errors: {len(errors)}" + "".join(f"\n  {e}" for e in errors))
    print(f"screenshot: {shot}")
    return 0 if all(checks.values()) and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
