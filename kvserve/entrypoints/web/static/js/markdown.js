// A small Markdown renderer for model replies: fenced code, headings, lists, quotes, tables, rules,
// paragraphs; inline code, bold, italic, and http(s) links.
//
// Safety by construction: the text only ever reaches the page as text nodes (node.append(string) and
// textContent), never as markup, so whatever a model writes (`<img src=x onerror=...>`, `<script>`) is shown
// as those characters. Elements are created by this code, with attributes this code chooses; the one
// attribute taken from the text, a link's href, must parse as an http: or https: URL.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const BULLET = /^ {0,3}[-*+]\s+(.*)$/;
const ORDERED = /^ {0,3}(\d{1,9})[.)]\s+(.*)$/;
const TABLE_DIVIDER = /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/;

// Inline spans, first match wins: `code`, **bold**, __bold__, *italic*, _italic_, [text](http://url).
// Underscores count only at word edges, so snake_case_names stay as they are.
const INLINE = new RegExp([
  '(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)',
  '\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*',
  '(?<![\\w])__(?=\\S)([\\s\\S]*?\\S)__(?![\\w])',
  '\\*(?=[^\\s*])([^*]*?[^\\s*])\\*',
  '(?<![\\w])_(?=[^\\s_])([^_]*?[^\\s_])_(?![\\w])',
  '\\[([^\\]\\n]+)\\]\\((https?:\\/\\/[^\\s()]+)\\)',
].join('|'), 'g');

function element(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

function safeUrl(text) {
  try {
    const url = new URL(text);
    return url.protocol === 'http:' || url.protocol === 'https:' ? url.href : null;
  } catch {
    return null;
  }
}

export function appendInline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    let node;
    if (m[1] !== undefined) {
      node = element('code');
      node.textContent = m[2];
    } else if (m[3] !== undefined || m[4] !== undefined) {
      node = element('strong');
      appendInline(node, m[3] ?? m[4]);
    } else if (m[5] !== undefined || m[6] !== undefined) {
      node = element('em');
      appendInline(node, m[5] ?? m[6]);
    } else {
      const href = safeUrl(m[8]);
      if (href) {
        node = element('a');
        node.href = href;
        node.target = '_blank';
        node.rel = 'noopener noreferrer';
        appendInline(node, m[7]);
      } else {
        node = document.createTextNode(m[0]);
      }
    }
    parent.append(node);
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function splitRow(line) {
  let row = line.trim();
  if (row.startsWith('|')) row = row.slice(1);
  if (row.endsWith('|')) row = row.slice(0, -1);
  return row.split('|').map((cell) => cell.trim());
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line)
    || BULLET.test(line) || ORDERED.test(line);
}

// A table starts at a line with a cell divider followed by a line of dashes; as in GFM, it may follow a
// paragraph's text or a list with no blank line between ("Here they are:\n| a | b |\n|---|---|").
// As in GFM, the header and the divider have as many cells, so that "a | b" over "---" stays text.
function startsTable(lines, i) {
  return lines[i].includes('|') && i + 1 < lines.length && TABLE_DIVIDER.test(lines[i + 1])
    && splitRow(lines[i]).length === splitRow(lines[i + 1]).length;
}

function indentOf(line) {
  return line.length - line.trimStart().length;
}

// Returns a DocumentFragment. An unclosed code fence (a reply still streaming) renders as code so far.
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, '\n').split('\n');
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i += 1;
    } else if ((m = FENCE.exec(line))) {
      const fence = m[1];
      const body = [];
      i += 1;
      while (i < lines.length && !isClosingFence(lines[i], fence)) body.push(lines[i++]);
      i += 1;   // the closing fence, or past the end
      const pre = element('pre');
      const code = element('code');
      if (m[2]) {
        code.className = `language-${m[2]}`;
        pre.dataset.lang = m[2];
      }
      code.textContent = body.join('\n');
      pre.append(code);
      fragment.append(pre);
    } else if ((m = HEADING.exec(line))) {
      const heading = element(`h${Math.min(6, m[1].length + 2)}`);
      appendInline(heading, m[2]);
      fragment.append(heading);
      i += 1;
    } else if (RULE.test(line)) {
      fragment.append(element('hr'));
      i += 1;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        inner.push(m[1]);
        i += 1;
      }
      const quote = element('blockquote');
      quote.append(renderMarkdown(inner.join('\n')));
      fragment.append(quote);
    } else if (BULLET.test(line) || ORDERED.test(line)) {
      const ordered = !BULLET.test(line);
      const pattern = ordered ? ORDERED : BULLET;
      const list = element(ordered ? 'ol' : 'ul');
      if (ordered) {
        const first = Number(ORDERED.exec(line)[1]);
        if (first !== 1) list.start = first;
      }
      // Each item: its text, and the lines indented under it (a nested list, a code block), rendered inside it.
      const indent = indentOf(line);
      const items = [];
      while (i < lines.length && lines[i].trim()) {
        const itemMatch = indentOf(lines[i]) <= indent + 1 ? pattern.exec(lines[i]) : null;
        if (itemMatch) items.push({ text: [ordered ? itemMatch[2] : itemMatch[1]], inner: [] });
        else if (indentOf(lines[i]) >= indent + 2 && (items[items.length - 1].inner.length || startsBlock(lines[i].trim())
                 || startsTable(lines, i))) items[items.length - 1].inner.push(lines[i].slice(indent + 2));
        else if (startsBlock(lines[i]) || startsTable(lines, i)) break;
        else items[items.length - 1].text.push(lines[i].trim());   // a continuation of the item's text
        i += 1;
      }
      for (const item of items) {
        const li = element('li');
        appendInline(li, item.text.join('\n'));
        if (item.inner.length) li.append(renderMarkdown(item.inner.join('\n')));
        list.append(li);
      }
      fragment.append(list);
    } else if (startsTable(lines, i)) {
      const table = element('table');
      const head = element('thead');
      const headRow = element('tr');
      for (const cell of splitRow(line)) {
        const th = element('th');
        appendInline(th, cell);
        headRow.append(th);
      }
      head.append(headRow);
      table.append(head);
      const body = element('tbody');
      i += 2;
      while (i < lines.length && lines[i].includes('|') && lines[i].trim()) {
        const tr = element('tr');
        for (const cell of splitRow(lines[i])) {
          const td = element('td');
          appendInline(td, cell);
          tr.append(td);
        }
        body.append(tr);
        i += 1;
      }
      table.append(body);
      const wrap = element('div', 'table-wrap');
      wrap.append(table);
      fragment.append(wrap);
    } else {
      const paragraph = [line];
      i += 1;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i]) && !startsTable(lines, i)) {
        paragraph.push(lines[i++]);
      }
      const p = element('p');
      appendInline(p, paragraph.join('\n'));
      fragment.append(p);
    }
  }
  return fragment;
}

function isClosingFence(line, fence) {
  const trimmed = line.trim();
  return trimmed.length >= fence.length && trimmed === fence[0].repeat(trimmed.length);
}
