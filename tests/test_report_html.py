"""memsim analyze --html: one self-contained page. Checked by its structure here (well formed,
no external resource, the pictures' data and the report's tables); benchmarks/html_in_browser.py
opens it in a real headless browser where one is installed (.ci/run)."""

from html.parser import HTMLParser

from memsim.cli import main

ARGS = ["analyze", "examples/nanogpt_block.py:small", "--input", "x=float32[B,S,64]",
        "--train", "--gpu", "h100-80gb"]
VOID = {"meta", "br", "img", "input", "link", "hr", "path", "use", "rect", "stop", "circle",
        "line", "polyline", "polygon", "ellipse"}


class _Tags(HTMLParser):
    """Checks that every element is closed in order; counts elements; notes resources."""

    def __init__(self):
        super().__init__()
        self.stack, self.count, self.resources, self.errors = [], {}, [], []

    def handle_starttag(self, tag, attrs):
        self.count[tag] = self.count.get(tag, 0) + 1
        for k, v in attrs:
            if k in ("src", "href") and v and not v.startswith("#"):
                self.resources.append((tag, k, v))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.count[tag] = self.count.get(tag, 0) + 1

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def test_html_report_is_one_well_formed_page(tmp_path, capsys):
    page = tmp_path / "report.html"
    assert main(ARGS + ["--at", "B=2,S=8", "--html", str(page)]) == 0
    text = capsys.readouterr().out          # stdout is still the text report
    html = page.read_text()
    p = _Tags()
    p.feed(html)
    assert p.errors == [] and p.stack == []
    assert p.resources == []                 # self-contained: nothing loaded from elsewhere
    assert "<script" not in html and "<link" not in html
    assert p.count["svg"] == 2               # the timeline and memory against size
    assert p.count["table"] >= 1 and p.count["h2"] == 3
    assert '<span class=badge>FITS</span> train step of examples/nanogpt_block.py:small at ' \
        'B=2, S=8' in html and "of H100 80GB HBM3's" in html
    # the full text report is in the page, escaped
    assert "Exact formulas (bytes" in html and "Training step" in html
    import html as markup
    assert all(line in markup.unescape(html) for line in text.splitlines()[:4])


def test_html_report_options_checked_before_tracing(tmp_path, capsys):
    no_gpu = ARGS[:-2]
    assert main(no_gpu + ["--html", str(tmp_path / "r.html")]) == 2
    assert "--html needs a point" in capsys.readouterr().err
    assert main(ARGS + ["--at", "B=2,S=8", "--html", str(tmp_path / "r.txt")]) == 2
    assert "not an .html file" in capsys.readouterr().err
