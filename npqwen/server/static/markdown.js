// Markdown -> DOM nodes, for model answers. The text is never parsed as HTML: every piece of it
// becomes a text node (textContent), and the only attribute taken from it is a link's href,
// allowed only for http(s) URLs. So "<script>" or "<img onerror=...>" in an answer is shown as
// those characters, and a [link](javascript:...) stays plain text.
//
// What is understood: fenced code blocks (``` or ~~~, also unclosed while streaming), headings,
// lists (- * + and 1.), block quotes, rules, paragraphs; inline `code`, **bold**, *italic*,
// [text](http://...) links and bare http(s) URLs.
"use strict";

const Markdown = (() => {
  const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s*>\s?/;
  const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const INLINE = new RegExp([
    /(`+)([^`][\s\S]*?)\1/.source,                          // groups 1-2: `code`
    /\*\*(\S[\s\S]*?)\*\*/.source,                          // 3: **bold**
    /\*(\S[^*]*?)\*/.source,                                // 4: *italic*
    /\[([^\]\n]+)\]\(([^()\s]+)\)/.source,                  // 5-6: [text](url)
    /(https?:\/\/[^\s<>()"']+[^\s<>()"'.,;:!?])/.source,     // 7: a bare URL (not its final punctuation)
  ].join("|"), "g");

  function element(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  function safeUrl(url) {
    // only absolute http(s) URLs; anything else (javascript:, data:, relative paths) is refused
    if (!/^https?:\/\//i.test(url)) return null;
    try {
      const parsed = new URL(url);
      return parsed.protocol === "http:" || parsed.protocol === "https:" ? parsed.href : null;
    } catch (e) {
      return null;
    }
  }

  function link(text, url) {
    const a = element("a");
    a.href = url;
    a.rel = "noopener noreferrer";
    a.target = "_blank";
    a.textContent = text;
    return a;
  }

  // Inline Markdown of `text` appended to `parent` as text nodes and elements.
  function inline(parent, text) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.append(text.slice(last, m.index));
      if (m[1] !== undefined) {
        const code = element("code");
        code.textContent = m[2];
        parent.append(code);
      } else if (m[3] !== undefined) {
        const strong = element("strong");
        inline(strong, m[3]);
        parent.append(strong);
      } else if (m[4] !== undefined) {
        const em = element("em");
        inline(em, m[4]);
        parent.append(em);
      } else if (m[5] !== undefined) {
        const url = safeUrl(m[6]);
        parent.append(url ? link(m[5], url) : m[0]);   // an unsafe link stays its own text
      } else {
        const url = safeUrl(m[7]);
        parent.append(url ? link(m[7], url) : m[7]);
      }
      last = m.index + m[0].length;
    }
    if (last < text.length) parent.append(text.slice(last));
  }

  // Lines joined by <br>: chat answers mean their line breaks.
  function inlineLines(parent, lines) {
    lines.forEach((line, i) => {
      if (i) parent.append(element("br"));
      inline(parent, line);
    });
  }

  function codeBlock(code, language) {
    const block = element("div", "code-block");
    const bar = element("div", "code-bar");
    const label = element("span");
    label.textContent = language || "code";
    const copy = element("button", "copy");
    copy.type = "button";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => {
      if (navigator.clipboard) navigator.clipboard.writeText(code).then(() => { copy.textContent = "Copied"; });
    });
    bar.append(label, copy);
    const pre = element("pre");
    const body = element("code");
    body.textContent = code;
    pre.append(body);
    block.append(bar, pre);
    return block;
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  // A DocumentFragment for the Markdown `text`.
  function render(text) {
    const root = document.createDocumentFragment();
    const lines = text.replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        const fence = m[1], code = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) code.push(lines[i]);
        i++;   // the closing fence (or past the end, while the block is still streaming)
        root.append(codeBlock(code.join("\n"), m[2]));
      } else if ((m = HEADING.exec(line))) {
        const heading = element("h" + Math.min(m[1].length + 2, 6));   // h3 .. h6 inside a message
        inline(heading, m[2]);
        root.append(heading);
        i++;
      } else if (RULE.test(line)) {
        root.append(element("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const quoted = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(lines[i].replace(QUOTE, ""));
        const quote = element("blockquote");
        quote.append(render(quoted.join("\n")));
        root.append(quote);
      } else if ((m = ITEM.exec(line))) {
        const ordered = /\d/.test(m[1]);
        const list = element(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[1], 10) !== 1) list.start = parseInt(m[1], 10);
        let item = null, itemLines = [];
        const close = () => { if (item) { inlineLines(item, itemLines); list.append(item); } };
        for (; i < lines.length; i++) {
          const im = ITEM.exec(lines[i]);
          if (im && /\d/.test(im[1]) === ordered) {
            close();
            item = element("li");
            itemLines = [im[2]];
          } else if (lines[i].trim() && /^\s/.test(lines[i]) && !FENCE.test(lines[i])) {
            itemLines.push(lines[i].trim());   // an indented line continues the item
          } else {
            break;
          }
        }
        close();
        root.append(list);
      } else if (!line.trim()) {
        i++;
      } else {
        const paragraph = [];
        for (; i < lines.length && lines[i].trim() && (!paragraph.length || !startsBlock(lines[i])); i++) {
          paragraph.push(lines[i]);
        }
        const p = element("p");
        inlineLines(p, paragraph);
        root.append(p);
      }
    }
    return root;
  }

  return { render, safeUrl };
})();
