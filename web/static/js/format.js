// Number, size, money and date formatting for tables and charts.
const integer = new Intl.NumberFormat(undefined, { maximumFractionDigits: 0 });
const compact = new Intl.NumberFormat(undefined, { notation: "compact", maximumFractionDigits: 1 });

export function formatInt(n) {
  return integer.format(Number(n) || 0);
}

export function formatCompact(n) {
  return compact.format(Number(n) || 0);
}

export function formatCost(n) {
  const value = Number(n) || 0;
  const digits = value !== 0 && Math.abs(value) < 0.01 ? 4 : 2;
  return `$${value.toFixed(digits)}`;
}

export function formatBytes(n) {
  const value = Number(n) || 0;
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  let v = value;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

// Accepts ISO strings or unix seconds (OpenAI records use seconds).
export function toDate(value) {
  if (value === null || value === undefined || value === "") return null;
  if (typeof value === "number") return new Date(value * 1000);
  const d = new Date(value);
  return Number.isNaN(d.getTime()) ? null : d;
}

export function formatDateTime(value) {
  const d = toDate(value);
  return d ? d.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" }) : "—";
}

// "YYYY-MM-DD" in UTC, the form <input type=date> and the usage API use.
export function isoDay(date) {
  return date.toISOString().slice(0, 10);
}
