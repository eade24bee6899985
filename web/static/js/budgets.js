// Budget panel of the usage page: the tenant's and this key's monthly budgets from /v1/usage/budgets.
// Hidden when there are none, or when the key may not read them (a 403 is not an error worth showing).
import { apiJson } from "./api.js";
import { h } from "./dom.js";
import { formatCost, formatInt } from "./format.js";

const panel = document.getElementById("budget-panel");
const list = document.getElementById("budget-list");
const resets = document.getElementById("budget-resets");

const resetLabel = (day) =>
  new Date(`${day}T00:00:00Z`).toLocaleDateString(undefined, { dateStyle: "medium", timeZone: "UTC" });

// One limit: "used of limit", what is left, and a bar that turns amber near the end and red when spent.
function meter(label, used, limit, remaining, format) {
  const share = limit > 0 ? Math.min(used / limit, 1) : 1;
  const state = share >= 1 ? "spent" : share >= 0.8 ? "near" : "ok";
  return h("div", { class: `budget-meter budget-${state}`, dataset: { kind: label.toLowerCase() } },
    h("div", { class: "budget-line" },
      h("span", { class: "budget-label" }, label),
      h("span", { class: "budget-used" }, `${format(used)} of ${format(limit)} used`),
      h("span", { class: "budget-left" }, `${format(remaining)} left`)),
    h("progress", { max: 1000, value: Math.round(share * 1000), "aria-label": `${label} budget used` }));
}

function budgetItem(budget) {
  const title = budget.scope === "tenant" ? "Whole tenant" : `This API key (${budget.api_key_id})`;
  const meters = [];
  if (budget.monthly_token_limit !== null) {
    meters.push(meter("Tokens", budget.used_tokens, budget.monthly_token_limit, budget.remaining_tokens, formatInt));
  }
  if (budget.monthly_cost_limit_usd !== null) {
    meters.push(meter("Cost", Number(budget.used_cost_usd), Number(budget.monthly_cost_limit_usd),
      Number(budget.remaining_cost_usd), formatCost));
  }
  if (meters.length === 0) meters.push(h("p", { class: "muted small" }, "No limit set."));
  return h("li", { class: "budget", dataset: { scope: budget.scope } }, h("h3", {}, title), ...meters);
}

export async function loadBudgets() {
  try {
    const status = await apiJson("/v1/usage/budgets", { noRedirect: true });
    panel.hidden = status.data.length === 0;
    resets.textContent = `Resets on ${resetLabel(status.resets_on)} (UTC).`;
    list.replaceChildren(...status.data.map(budgetItem));
  } catch {
    panel.hidden = true;
  }
}
