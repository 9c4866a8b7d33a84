// A small, safe markdown renderer for model answers.
//
// Safety rests on one rule: the whole source is HTML-escaped before anything else, and the
// only tags in the output are the fixed ones written below (no attribute ever carries model
// text except a fenced block's language, which is restricted to [\w+-]). Model text can
// therefore never become markup, whatever it contains.
//
// Supported: paragraphs (single newlines kept as line breaks), # headings, **bold**, *italic*,
// `code`, ``` fenced blocks ```, and flat "-", "*", "+" or "1." lists. An unclosed fence runs
// to the end, so a code block renders sensibly while it is still streaming in.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FENCE = /^\s*```\s*([\w+-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const LIST_ITEM = /^\s*(?:([-*+])|(\d{1,9})[.)])\s+(.*)$/;

export function renderMarkdown(source) {
  const lines = escapeHtml(source.replace(/\r\n?/g, "\n")).split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    const heading = line.match(HEADING);
    if (fence) {
      const body = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) body.push(lines[i]);
      i++; // the closing fence
      const lang = fence[1] ? ` class="language-${fence[1]}"` : "";
      out.push(`<pre><code${lang}>${body.join("\n")}</code></pre>`);
    } else if (!line.trim()) {
      i++;
    } else if (heading) {
      const level = heading[1].length;
      out.push(`<h${level}>${inline(heading[2])}</h${level}>`);
      i++;
    } else if (LIST_ITEM.test(line)) {
      const first = line.match(LIST_ITEM)[2]; // the number of an ordered list's first item
      const ordered = first !== undefined;
      const items = [];
      for (; i < lines.length; i++) {
        const item = lines[i].match(LIST_ITEM);
        if (!item || (item[2] !== undefined) !== ordered) break;
        items.push(`<li>${inline(item[3])}</li>`);
      }
      const start = ordered && Number(first) !== 1 ? ` start="${Number(first)}"` : "";
      out.push(ordered ? `<ol${start}>${items.join("")}</ol>` : `<ul>${items.join("")}</ul>`);
    } else {
      const paragraph = [];
      for (; i < lines.length && startsParagraphLine(lines[i]); i++) paragraph.push(inline(lines[i]));
      out.push(`<p>${paragraph.join("<br>")}</p>`);
    }
  }
  return out.join("");
}

function startsParagraphLine(line) {
  return line.trim() !== "" && !FENCE.test(line) && !HEADING.test(line) && !LIST_ITEM.test(line);
}

// Inline spans of one (already escaped) line. Code spans are cut out first so that their
// contents are never read as emphasis: after the split, odd pieces are the spans.
function inline(text) {
  return text
    .split(/(`[^`]+`)/)
    .map((piece, k) => (k % 2 ? `<code>${piece.slice(1, -1)}</code>` : emphasis(piece)))
    .join("");
}

// A marker must hug its text ("2 * 3 * 4" stays as it is).
function emphasis(text) {
  return text
    .replace(/\*\*(\S(?:.*?\S)?)\*\*/g, "<strong>$1</strong>")
    .replace(/\*([^\s*](?:[^*]*[^\s*])?)\*/g, "<em>$1</em>");
}
