"""Open memsim's HTML reports in a real headless browser and check that a person can read them:
no console error; the verdict in the first screen (1400 x 900); in every picture, no two pieces
of text overlap (their boxes as the browser lays them out); the timeline's data fills a
sensible part of its axis; the page under 500 KB. A screenshot of each is saved.

The reports are the ones ``memsim analyze ... --html`` writes for the README's nanoGPT block
(fits on an H100) and GPT-2 at B=16, S=1024 on an A10 (does not fit: the card's lines, where
the allocator runs out, a regime change, the model's limit). The browser is the system's
Chromium (Debian's ``chromium`` package, or Google Chrome), driven from its command line: a
copy of each page with a measuring script appended is loaded with ``--dump-dom``, the script
writing what it measured into the page; ``--screenshot`` for the picture,
``--enable-logging=stderr`` for the console. Where no such browser is installed the check fails
(exit 1), saying how to install one: a check that could not run has not passed. ``.ci/run``
installs Debian's ``chromium`` where no browser is found, then runs it after the tests.

    python -m benchmarks.html_in_browser [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
            "chrome-headless-shell")


# appended to a copy of the page: measures what a reader sees and writes it into the page
MEASURE = """<script>
window.addEventListener('load', () => {
  const out = {overlaps: [], spans: []};
  const v = document.querySelector('.verdict');
  out.verdict_bottom = v ? v.getBoundingClientRect().bottom + window.scrollY : null;
  document.querySelectorAll('svg').forEach((svg, k) => {
    const texts = [...svg.querySelectorAll('text')].filter(t => t.textContent.trim())
      .map(t => [t.textContent.trim(), t.getBoundingClientRect()]);
    for (let i = 0; i < texts.length; i++) for (let j = i + 1; j < texts.length; j++) {
      const [a, ra] = texts[i], [b, rb] = texts[j];
      const w = Math.min(ra.right, rb.right) - Math.max(ra.left, rb.left);
      const h = Math.min(ra.bottom, rb.bottom) - Math.max(ra.top, rb.top);
      if (w > 1 && h > 1) out.overlaps.push([k, a, b]);
    }
    const axes = svg.querySelector('g[id^="patch_2"]');
    const fills = [...svg.querySelectorAll('g[id*="PolyCollection"]')];
    if (axes && fills.length) {
      const top = Math.min(...fills.map(f => f.getBoundingClientRect().top));
      const ra = axes.getBoundingClientRect();
      out.spans.push([k, (ra.bottom - top) / ra.height]);
    }
    out.texts = (out.texts || 0) + texts.length;
  });
  const pre = document.createElement('pre');
  pre.id = 'legibility';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""

REPORTS = {
    "nanogpt": ["analyze", "examples/nanogpt_block.py:small", "--input", "x=float32[B,S,64]",
                "--at", "B=2,S=8", "--train", "--gpu", "h100-80gb"],
    "gpt2": ["analyze", "examples/gpt2.py:model", "--input", "input_ids=int64[B,S]",
             "--input", "labels=int64[B,S]", "--at", "B=16,S=1024", "--gpu", "A10",
             "--no-options", "--quiet"],
}


def check(browser: str, name: str, page: str, out: str) -> dict:
    """What a reader of ``page`` sees: the checks, by name, true where they pass."""
    url = "file://" + os.path.abspath(page)
    common = [browser, "--headless=new", "--disable-gpu", "--no-sandbox",
              "--window-size=1400,900"]
    shot = os.path.join(out, f"{name}.png")
    run = subprocess.run(common[:-1] + ["--window-size=1400,2400", "--enable-logging=stderr",
                                        "--v=0", f"--screenshot={shot}", url],
                         capture_output=True, text=True, timeout=120)
    console = [ln for ln in run.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    errors = [ln for ln in console if re.search(r"error|uncaught", ln, re.I)]
    measured = os.path.join(out, f"{name}.measure.html")
    with open(page, encoding="utf-8") as f:
        text = f.read()
    with open(measured, "w", encoding="utf-8") as f:
        f.write(text.replace("</body>", MEASURE + "</body>"))
    dom = subprocess.run(common + ["--virtual-time-budget=5000", "--dump-dom",
                                   "file://" + os.path.abspath(measured)],
                         capture_output=True, text=True, timeout=120).stdout
    got = re.search(r'<pre id="legibility">(.*?)</pre>', dom, re.S)
    m = json.loads(got.group(1).replace("&quot;", '"').replace("&amp;", "&")) if got else {}
    for o in m.get("overlaps", []):
        print(f"  {name}: picture {o[0] + 1}: {o[1]!r} overlaps {o[2]!r}")
    size = os.path.getsize(page)
    return {
        "measured in the browser": bool(m),
        "no console error": not errors,
        "verdict in the first screen": m.get("verdict_bottom") is not None
        and m["verdict_bottom"] <= 900,
        "pictures' text laid out": m.get("texts", 0) > 20,
        "no overlapping text": m.get("overlaps") == [],
        "timeline data fills half its axis or more": bool(m.get("spans"))
        and m["spans"][0][1] >= 0.5,
        f"page under 500 KB ({size // 1000} KB)": size < 500_000,
        "screenshot": os.path.exists(shot) and os.path.getsize(shot) > 10_000,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="where the reports and screenshots go")
    args = ap.parse_args()
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        print("FAILED: the check could not run: no headless browser installed (looked for "
              + ", ".join(BROWSERS) + " on PATH); install one, e.g. on Debian or Ubuntu "
              "`apt-get install -y chromium`, and run it again", file=sys.stderr)
        return 1
    out = args.out or tempfile.mkdtemp(prefix="memsim-html-")
    os.makedirs(out, exist_ok=True)
    from memsim.cli import main as memsim
    ok = True
    for name, argv in REPORTS.items():
        page = os.path.join(out, f"{name}.html")
        if memsim(argv + ["--html", page]) not in (0, 1):
            print(f"{name}: memsim analyze --html failed")
            ok = False
            continue
        for what, passed in check(browser, name, page, out).items():
            print(f"{name}: {what}: {'ok' if passed else 'FAILED'}")
            ok = ok and passed
    print(f"screenshots and pages: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
