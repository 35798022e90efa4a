// A line chart in inline SVG: one card with a title, the current value as text, a legend with each series'
// current value, and the lines over the chosen time window. Null points leave gaps.

const SVG = 'http://www.w3.org/2000/svg';
const WIDTH = 420;
const HEIGHT = 150;
const PAD = { left: 46, right: 8, top: 8, bottom: 18 };

function svg(tag, attributes = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  return node;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// Units: how a value reads as text.
export const FORMATS = {
  count: (v) => (Number.isInteger(v) ? v.toLocaleString('en-US') : v.toFixed(1)),
  percent: (v) => `${(v * 100).toFixed(1)}%`,
  rate: (v) => `${v < 10 ? v.toFixed(1) : Math.round(v).toLocaleString('en-US')} tok/s`,
  seconds: (v) => (v < 1 ? `${(v * 1000).toFixed(v < 0.01 ? 1 : 0)} ms` : `${v.toFixed(2)} s`),
};

export function format(unit, value) {
  return value === null || value === undefined || Number.isNaN(value) ? '–' : FORMATS[unit](value);
}

// Axis labels are short (the unit is in the legend): 10, 50%, 250 ms.
const AXIS_FORMATS = {
  count: (v) => String(v),
  percent: (v) => `${Math.round(v * 100)}%`,
  rate: (v) => (v >= 10000 ? `${v / 1000}k` : String(v)),
  seconds: (v) => (v === 0 ? '0' : FORMATS.seconds(v)),
};

// The smallest of 1, 2, 5 x 10^k at or above v: a round top for the y axis.
function niceCeil(v) {
  if (!(v > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(v));
  for (const step of [1, 2, 5, 10]) if (step * power >= v) return step * power;
  return 10 * power;
}

function lastValue(values) {
  for (let i = values.length - 1; i >= 0; i -= 1) if (values[i] !== null && values[i] !== undefined) return values[i];
  return null;
}

export class LineChart {
  // spec: { id, title, unit, note?, max? } (max fixes the y axis top, e.g. 1 for fractions)
  constructor(parent, spec) {
    this.spec = spec;
    this.card = element('figure', 'chart');
    this.card.dataset.chart = spec.id;
    const head = element('div', 'chart-head');
    const titles = element('div');
    titles.append(element('h3', 'chart-title', spec.title));
    if (spec.note) titles.append(element('span', 'chart-note', spec.note));
    this.value = element('span', 'chart-value', '–');
    this.value.dataset.current = '';
    head.append(titles, this.value);
    this.legend = element('ul', 'legend');
    this.svg = svg('svg', { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: 'img', 'aria-label': spec.title });
    this.card.append(head, this.svg, this.legend);
    parent.append(this.card);
  }

  // times: seconds (one per point); series: [{ label, values }]; windowS: the span the x axis shows.
  update(times, series, windowS) {
    const { unit } = this.spec;
    const current = series.map((s) => lastValue(s.values));
    this.value.textContent = format(unit, current[0]);

    this.legend.replaceChildren(...series.map((s, k) => {
      const item = element('li');
      item.dataset.series = s.label;
      const swatch = element('span', `swatch c${k}`);
      item.append(swatch, element('span', 'legend-label', s.label), element('span', 'legend-value', format(unit, current[k])));
      return item;
    }));

    const plot = { x0: PAD.left, x1: WIDTH - PAD.right, y0: HEIGHT - PAD.bottom, y1: PAD.top };
    let top = this.spec.max;
    if (top === undefined) {
      const finite = series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined);
      top = niceCeil(Math.max(0, ...finite));
    }
    const end = times.length ? times[times.length - 1] : 0;
    const x = (t) => plot.x0 + ((t - (end - windowS)) / windowS) * (plot.x1 - plot.x0);
    const y = (v) => plot.y0 - (Math.min(v, top) / top) * (plot.y0 - plot.y1);

    const nodes = [];
    for (const fraction of [0, 0.5, 1]) {
      const v = top * fraction;
      const gy = y(v);
      nodes.push(svg('line', { x1: plot.x0, x2: plot.x1, y1: gy, y2: gy, class: 'grid' }));
      if (unit === 'count' && !Number.isInteger(v)) continue;   // no half requests on the axis
      const label = svg('text', { x: plot.x0 - 4, y: gy + 3, class: 'axis', 'text-anchor': 'end' });
      label.textContent = AXIS_FORMATS[unit](v);
      nodes.push(label);
    }
    for (const [t, text, anchor] of [[end - windowS, `−${Math.round(windowS / 60)} min`, 'start'], [end, 'now', 'end']]) {
      const label = svg('text', { x: x(t), y: HEIGHT - 4, class: 'axis', 'text-anchor': anchor });
      label.textContent = text;
      nodes.push(label);
    }
    series.forEach((s, k) => {
      let d = '';
      let run = 0;   // points in the current unbroken stretch; a lone point gets a tiny stroke so it shows
      const endRun = () => {
        if (run === 1) d += 'h0.1';
        run = 0;
      };
      s.values.forEach((v, i) => {
        if (v === null || v === undefined || times[i] < end - windowS) {
          endRun();
          return;
        }
        d += `${run ? 'L' : 'M'}${x(times[i]).toFixed(1)},${y(v).toFixed(1)}`;
        run += 1;
      });
      endRun();
      if (d) nodes.push(svg('path', { d, class: `line c${k}` }));
    });
    this.svg.replaceChildren(...nodes);
  }

  set hidden(value) {
    this.card.hidden = value;
  }
}
