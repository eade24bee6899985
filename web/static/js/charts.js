// SVG charts drawn in the browser: no library, no build step. Each chart is
// sized to its container and redrawn when the container changes width.
// Colours come from CSS classes (.series-N), so the stylesheet owns the palette.

const SVG_NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, value);
  for (const child of children) el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return el;
}

// Round axis maximum and tick step: 1, 2 or 5 times a power of ten.
export function niceScale(max, numTicks = 4) {
  if (!(max > 0)) return { max: 1, step: 0.25 };
  const rough = max / numTicks;
  const power = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= rough);
  return { max: Math.ceil(max / step) * step, step };
}

function emptyNote(container, text) {
  container.replaceChildren(Object.assign(document.createElement("p"), { className: "chart-empty", textContent: text }));
}

function legend(series) {
  const list = document.createElement("ul");
  list.className = "legend";
  series.forEach((s, i) => {
    const item = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.className = `swatch series-${s.colorIndex ?? i}`;
    item.append(swatch, s.name);
    list.append(item);
  });
  return list;
}

function observeWidth(container, draw) {
  container._chartObserver?.disconnect();
  let lastWidth = 0;
  const observer = new ResizeObserver(() => {
    const width = container.clientWidth;
    if (Math.abs(width - lastWidth) > 8) {
      lastWidth = width;
      draw(width);
    }
  });
  container._chartObserver = observer;
  observer.observe(container);
}

// Vertical bars, one per label, each stacked from the series' values.
export function stackedBarChart(container, { labels, series, formatValue, formatLabel = String, ariaLabel }) {
  const totals = labels.map((_, i) => series.reduce((sum, s) => sum + (s.values[i] || 0), 0));
  if (!labels.length || !totals.some((t) => t > 0)) {
    emptyNote(container, "No data in this range.");
    container._chartObserver?.disconnect();
    return;
  }
  const draw = (width) => {
    const height = 240;
    const pad = { top: 12, right: 8, bottom: 28, left: 52 };
    const plotW = Math.max(width - pad.left - pad.right, 40);
    const plotH = height - pad.top - pad.bottom;
    const { max, step } = niceScale(Math.max(...totals));
    const y = (v) => pad.top + plotH - (v / max) * plotH;
    const slot = plotW / labels.length;
    const barW = Math.max(Math.min(slot * 0.7, 48), 2);
    const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, width, height, role: "img", "aria-label": ariaLabel, class: "chart-svg" });
    for (let v = 0; v <= max + step / 2; v += step) {
      root.append(svg("line", { x1: pad.left, x2: width - pad.right, y1: y(v), y2: y(v), class: "grid" }));
      root.append(svg("text", { x: pad.left - 6, y: y(v) + 4, class: "tick tick-y" }, formatValue(v)));
    }
    // at most ~one label per 56px so they never overlap
    const every = Math.ceil(labels.length / Math.max(Math.floor(plotW / 56), 1));
    labels.forEach((label, i) => {
      const x = pad.left + slot * i + (slot - barW) / 2;
      let base = 0;
      series.forEach((s, k) => {
        const value = s.values[i] || 0;
        if (value <= 0) return;
        const rect = svg("rect", {
          x, width: barW, y: y(base + value), height: Math.max(y(base) - y(base + value), 0.5),
          class: `bar series-${s.colorIndex ?? k}`,
        }, svg("title", {}, `${formatLabel(label)} · ${s.name}: ${formatValue(value)}`));
        root.append(rect);
        base += value;
      });
      if (i % every === 0) {
        root.append(svg("text", { x: x + barW / 2, y: height - 8, class: "tick tick-x" }, formatLabel(label)));
      }
    });
    container.replaceChildren(root, legend(series));
  };
  draw(container.clientWidth || 600);
  observeWidth(container, draw);
}

// Horizontal bars, largest first: cost per adapter, requests per key.
export function horizontalBarChart(container, { items, formatValue, ariaLabel, colorIndex = 0 }) {
  const rows = items.filter((it) => it.value > 0).sort((a, b) => b.value - a.value);
  if (!rows.length) {
    emptyNote(container, "No data in this range.");
    container._chartObserver?.disconnect();
    return;
  }
  const draw = (width) => {
    const rowH = 30;
    const labelW = Math.min(Math.max(width * 0.32, 90), 180);
    const valueW = 72;
    const height = rows.length * rowH + 4;
    const plotW = Math.max(width - labelW - valueW, 20);
    const max = Math.max(...rows.map((r) => r.value));
    const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, width, height, role: "img", "aria-label": ariaLabel, class: "chart-svg" });
    rows.forEach((row, i) => {
      const top = i * rowH + 4;
      const barLen = Math.max((row.value / max) * plotW, 2);
      const maxChars = Math.floor((labelW - 12) / 7.4);
      const label = row.label.length > maxChars ? `${row.label.slice(0, maxChars - 1)}…` : row.label;
      root.append(
        // a shortened label keeps its full name in the bar's tooltip
        svg("text", { x: labelW - 8, y: top + rowH / 2, class: "tick tick-label" }, label),
        svg("rect", { x: labelW, y: top + 5, width: barLen, height: rowH - 12, rx: 3, class: `bar series-${colorIndex}` },
          svg("title", {}, `${row.label}: ${formatValue(row.value)}`)),
        svg("text", { x: labelW + barLen + 6, y: top + rowH / 2, class: "tick tick-value" }, formatValue(row.value)),
      );
    });
    container.replaceChildren(root);
  };
  draw(container.clientWidth || 400);
  observeWidth(container, draw);
}
