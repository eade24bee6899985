// Usage page: date range -> three group-bys of /v1/usage -> charts, table, totals; CSV download;
// the per-request log of the same range (requests.js).
import { apiFetch, apiJson } from "./api.js";
import { loadBudgets } from "./budgets.js";
import { horizontalBarChart, stackedBarChart } from "./charts.js";
import { clearError, h, showError } from "./dom.js";
import { formatCompact, formatCost, formatInt, isoDay } from "./format.js";
import { namesFor } from "./adapter_names.js";
import { loadRequests } from "./requests.js";
import { requireApiKey } from "./session.js";

// The report's classes nest (cached input is part of input, thinking part of
// output), so the chart stacks the four disjoint parts; the table shows the fields as reported.
export const TOKEN_CLASSES = [
  { key: "input_tokens", name: "Input" },
  { key: "cached_input_tokens", name: "Cached input" },
  { key: "output_tokens", name: "Output" },
  { key: "thinking_tokens", name: "Thinking" },
];
const STACKED_CLASSES = [
  { name: "Input (not cached)", value: (row) => row.input_tokens - row.cached_input_tokens },
  { name: "Cached input", value: (row) => row.cached_input_tokens },
  { name: "Output (answer)", value: (row) => row.output_tokens - row.thinking_tokens },
  { name: "Thinking", value: (row) => row.thinking_tokens },
];

const form = document.getElementById("range-form");
const startInput = document.getElementById("range-start");
const endInput = document.getElementById("range-end");
const errorEl = document.getElementById("usage-error");
const csvButton = document.getElementById("csv-download");
const totalsEl = document.getElementById("usage-totals");
const table = document.getElementById("usage-table");
const tbody = document.getElementById("usage-body");
const tfoot = document.getElementById("usage-foot");
const emptyNote = document.getElementById("usage-empty");

function setRange(days) {
  const end = new Date();
  const start = new Date(end.getTime() - (days - 1) * 86_400_000);
  startInput.value = isoDay(start);
  endInput.value = isoDay(end);
}

function rangeParams() {
  return { start: startInput.value, end: endInput.value };
}

function rangeProblem() {
  if (!startInput.value || !endInput.value) return "Choose both dates.";
  if (startInput.value > endInput.value) return "The start date is after the end date.";
  return null;
}

// Every day of the range, so days without traffic show as gaps, not missing.
function daysBetween(start, end) {
  const days = [];
  for (let d = new Date(`${start}T00:00:00Z`); isoDay(d) <= end; d = new Date(d.getTime() + 86_400_000)) {
    days.push(isoDay(d));
  }
  return days;
}

const dayLabel = (day) => new Date(`${day}T00:00:00Z`).toLocaleDateString(undefined, { month: "short", day: "numeric", timeZone: "UTC" });

function renderTotals(total) {
  const tile = (label, value) => h("div", { class: "tile" }, h("span", { class: "tile-label" }, label), h("span", { class: "tile-value" }, value));
  totalsEl.replaceChildren(
    tile("Requests", formatInt(total.requests)),
    tile("Tokens", formatCompact(total.total_tokens)),
    tile("Thinking tokens", formatCompact(total.thinking_tokens)),
    tile("Cost", formatCost(total.cost_usd)),
  );
}

function renderTable(byDay, total) {
  const cells = (row) => [
    h("td", { class: "num", "data-label": "Requests" }, formatInt(row.requests)),
    ...TOKEN_CLASSES.map((c) => h("td", { class: "num", "data-label": c.name }, formatInt(row[c.key]))),
    h("td", { class: "num", "data-label": "Cost" }, formatCost(row.cost_usd)),
  ];
  tbody.replaceChildren(...byDay.map((row) => h("tr", {}, h("th", { scope: "row" }, row.day), ...cells(row))));
  tfoot.replaceChildren(h("tr", {}, h("th", { scope: "row" }, "Total"), ...cells(total)));
  table.hidden = byDay.length === 0;
  emptyNote.hidden = byDay.length !== 0;
}

function renderCharts(byDay, byAdapter, byKey, adapterNames) {
  const { start, end } = rangeParams();
  const days = daysBetween(start, end);
  const index = new Map(byDay.map((row) => [row.day, row]));
  stackedBarChart(document.getElementById("chart-tokens"), {
    labels: days,
    series: STACKED_CLASSES.map((c) => ({
      name: c.name, values: days.map((d) => (index.has(d) ? c.value(index.get(d)) : 0)),
    })),
    formatValue: formatCompact,
    formatLabel: dayLabel,
    ariaLabel: "Tokens per day, stacked by class",
  });
  horizontalBarChart(document.getElementById("chart-cost"), {
    items: byAdapter.map((row) => ({
      label: row.adapter === null ? "base model" : adapterNames.get(row.adapter) ?? row.adapter,
      value: row.cost_usd,
    })),
    formatValue: formatCost,
    ariaLabel: "Cost per adapter",
    colorIndex: 4,
  });
  horizontalBarChart(document.getElementById("chart-keys"), {
    items: byKey.map((row) => ({ label: row.api_key ?? "no key", value: row.requests })),
    formatValue: formatInt,
    ariaLabel: "Requests per API key",
    colorIndex: 5,
  });
}

async function load() {
  clearError(errorEl);
  const problem = rangeProblem();
  if (problem) {
    showError(errorEl, problem);
    return;
  }
  document.body.classList.add("loading");
  try {
    const report = (groupBy) => apiJson("/v1/usage", { params: { ...rangeParams(), group_by: groupBy, format: "json" } });
    const requests = loadRequests(rangeParams());
    const [byDay, byAdapter, byKey] = await Promise.all([report("day"), report("adapter"), report("api_key")]);
    const adapterNames = await namesFor(byAdapter.data.map((row) => row.adapter));
    renderTotals(byDay.totals);
    renderTable(byDay.data, byDay.totals);
    renderCharts(byDay.data, byAdapter.data, byKey.data, adapterNames);
    history.replaceState(null, "", `?${new URLSearchParams(rangeParams())}`);
    await requests;
  } catch (err) {
    showError(errorEl, `Cannot load usage: ${err.message}`);
  } finally {
    document.body.classList.remove("loading");
    document.body.dataset.loaded = "true";
  }
}

// The CSV comes from the API (format=csv); fetched with the key, then saved as a file.
async function downloadCsv() {
  clearError(errorEl);
  const problem = rangeProblem();
  if (problem) {
    showError(errorEl, problem);
    return;
  }
  try {
    const { start, end } = rangeParams();
    const response = await apiFetch("/v1/usage", { params: { start, end, group_by: "day", format: "csv" } });
    const url = URL.createObjectURL(await response.blob());
    const link = h("a", { href: url, download: `usage-${start}-to-${end}.csv`, hidden: true });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
  } catch (err) {
    showError(errorEl, `Cannot download CSV: ${err.message}`);
  }
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  load();
});
for (const button of form.querySelectorAll("[data-days]")) {
  button.addEventListener("click", () => {
    setRange(Number(button.dataset.days));
    load();
  });
}
csvButton.addEventListener("click", downloadCsv);

if (requireApiKey()) {
  const params = new URLSearchParams(window.location.search);
  if (params.get("start") && params.get("end")) {
    startInput.value = params.get("start");
    endInput.value = params.get("end");
  } else {
    setRange(30);
  }
  load();
  loadBudgets();
}
