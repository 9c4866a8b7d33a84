"""mmserve/web/markdown.js, run in the browser: model text never becomes markup."""

from __future__ import annotations

import pytest
from chat_page import OFFLINE_URL, serve_web_dir

ATTACKS = [
    "<img src=x onerror=alert(1)>",
    "**<img src=x onerror=alert(1)>**",
    "*<script>alert(1)</script>*",
    "`<img src=x onerror=alert(1)>`",
    "```html\n<img src=x onerror=alert(1)>\n```",
    "- <a href=javascript:alert(1)>x</a>\n- <svg onload=alert(1)>",
    '```"><img src=x onerror=alert(1)>\ncode\n```',
    "# <iframe srcdoc='<script>alert(1)</script>'>",
]


@pytest.fixture(scope="module")
def render(browser):
    """renderMarkdown(text) -> [html, the element names it produces when put into the DOM].

    One page serves the whole module: rendering has no state, and a page per case is slow."""
    context = browser.new_context()
    page = context.new_page()
    serve_web_dir(page)
    page.goto(OFFLINE_URL + "static/markdown.js")  # any page of the origin, to import from

    def run(text: str) -> tuple[str, list[str]]:
        return page.evaluate(
            """async (text) => {
                const { renderMarkdown } = await import("/static/markdown.js");
                const html = renderMarkdown(text);
                const probe = document.createElement("div");
                probe.innerHTML = html;
                return [html, [...probe.querySelectorAll("*")].map((e) => e.localName)];
            }""",
            text,
        )

    yield run
    context.close()


@pytest.mark.parametrize("attack", ATTACKS)
def test_html_in_model_text_is_escaped(render, attack):
    html, elements = render(attack)
    assert not {"img", "script", "a", "svg", "iframe"} & set(elements)
    assert "<img" not in html and "<script" not in html
    assert "&lt;" in html


def test_the_escaped_text_reads_as_written(render):
    html, _ = render("<img src=x onerror=alert(1)>")
    assert html == "<p>&lt;img src=x onerror=alert(1)&gt;</p>"


@pytest.mark.parametrize(
    ("source", "html"),
    [
        ("one\ntwo\n\nthree", "<p>one<br>two</p><p>three</p>"),
        ("**bold** and *italic*", "<p><strong>bold</strong> and <em>italic</em></p>"),
        ("2 * 3 * 4", "<p>2 * 3 * 4</p>"),
        ("`a *b* c`", "<p><code>a *b* c</code></p>"),
        (
            "```py\nx = 1\n\ny = 2\n```\nafter",
            '<pre><code class="language-py">x = 1\n\ny = 2</code></pre><p>after</p>',
        ),
        ("```\nstill streaming", "<pre><code>still streaming</code></pre>"),
        ("- a\n- **b**", "<ul><li>a</li><li><strong>b</strong></li></ul>"),
        ("3. c\n4. d", '<ol start="3"><li>c</li><li>d</li></ol>'),
        ("## Title", "<h2>Title</h2>"),
    ],
)
def test_markdown_subset(render, source, html):
    assert render(source)[0] == html
