// Usage data names adapters by id; the adapters list (when this key may read it) gives their names.
// Fetched once per page load and shared by the charts and the requests table.
import { apiJson } from "./api.js";

let names = null;

export function adapterNames() {
  names ??= apiJson("/v1/adapters", { noRedirect: true })
    .then(({ data }) => new Map(data.map((a) => [a.id, a.name])))
    .catch(() => new Map());
  return names;
}

// Names only when some row has an adapter: a tenant without adapters never asks.
export async function namesFor(adapterIds) {
  return adapterIds.some((id) => id !== null && id !== undefined) ? adapterNames() : new Map();
}
