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
    assert p.count["table"] >= 1 and p.count["h2"] == 2
    # the full text report last, collapsed; what is live at the peak with a total row
    assert p.count["details"] == 1 and html.rindex("<details") > html.rindex("<svg")
    assert "total live at the peak" in html
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


def test_the_timeline_shows_the_card_and_where_the_allocator_runs_out(tmp_path, capsys):
    """--memory 460MiB: the card far above the step is named in the legend, not drawn; the
    share the allocator may use (90% less the CUDA context: the budget's own limit) is drawn,
    and where the replay confined to it runs out is marked."""
    page = tmp_path / "r.html"
    assert main(ARGS[:-2] + ["--memory", "460MiB", "--at", "B=2,S=8", "--no-options",
                             "--html", str(page)]) == 0
    html = page.read_text()
    assert "DOES NOT FIT" in html
    assert "the memory given: 460.00 MiB: above the plot" in html
    assert "usable by the allocator: 14.00 MiB (90%, less 400.00 MiB outside it)" in html
    assert "out of memory by here" in html
    # the limit drawn is the one the budget's note names; the text does not claim a cache of
    # 0 B where the replay ran out
    text = capsys.readouterr().out
    assert "cannot be reserved within 14,680,064 B" in text
    assert "cached by the allocator: not known, the replay ran out of memory" in text
    assert "cached by the allocator, not allocated (replayed)" not in text


def test_live_at_the_peak_groups_repeated_blocks():
    from types import SimpleNamespace

    from memsim.analysis.timeline import LiveGroup
    from memsim.plots import _at_peak_table, at_peak_rows
    groups = [LiveGroup(f"h.{i}.mlp", "activation", 100, 2) for i in range(12)] + [
        LiveGroup("-", "temporary", 500, 1), LiveGroup("", "activation", 50, 1)] + [
        LiveGroup(f"x{i}", "temporary", 10 - i, 1) for i in range(12)]
    tl = SimpleNamespace(at_peak=groups)
    rows, more, total = at_peak_rows(tl)
    assert rows[0] == ("h.*.mlp", 12, "activation", 24, 1200)
    assert rows[1] == ("-", 1, "temporary", 1, 500)
    assert [r[0] for r in rows[3:]] == [f"x{i}" for i in range(9)]   # largest first
    assert (more, total) == (3, 1200 + 500 + 50 + sum(10 - i for i in range(12)))
    table = _at_peak_table(tl, "")
    assert "h.*.mlp &times; 12" in table and "3 more" in table
    assert "(no module: the loop, the optimizer)" in table and "(the model itself)" in table
    assert "total live at the peak" in table
    # an nn.Sequential's children are numbered at the top
    rows, _, _ = at_peak_rows(SimpleNamespace(at_peak=[
        LiveGroup(f"{i}.act", "activation", 7, 1) for i in range(3)]))
    assert rows == [("*.act", 3, "activation", 3, 21)]
    # block2 before block10 where the bytes are equal
    rows, _, _ = at_peak_rows(SimpleNamespace(at_peak=[
        LiveGroup("block10", "activation", 5, 1), LiveGroup("block2", "temporary", 5, 1)]))
    assert [r[0] for r in rows] == ["block2", "block10"]
