// Calls to the public /v1 API with the signed-in key; errors come back in the
// OpenAI shape {"error": {"message", "type", "code"}} and are raised as ApiError.
import { clearApiKey, getApiKey, redirectToSignIn, root } from "./session.js";

export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function apiUrl(path, params = null) {
  const query = params ? `?${new URLSearchParams(params)}` : "";
  return `${root}${path}${query}`;
}

export function authHeaders(key = getApiKey()) {
  return { Authorization: `Bearer ${key}` };
}

// The message the server gave, or one built from the status when the body is not ours.
export function errorFromBody(status, text) {
  try {
    const body = JSON.parse(text);
    const error = body?.error ?? body;
    const message = typeof error === "string" ? error : error?.message ?? body?.detail;
    if (message) return new ApiError(status, String(message), error?.code ?? null);
  } catch {
    // not JSON: fall through to the generic message
  }
  return new ApiError(status, `Request failed (HTTP ${status})`);
}

// fetch with the key; a 401 means the key is gone or revoked: forget it (or sign-in
// would hand the dead key straight back) and sign in again.
export async function apiFetch(path, { params = null, key = getApiKey(), noRedirect = false, ...init } = {}) {
  const headers = { ...authHeaders(key), ...(init.headers ?? {}) };
  let response;
  try {
    response = await fetch(apiUrl(path, params), { ...init, headers });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "Cannot reach the server. Check your connection and try again.");
  }
  if (response.status === 401 && key === getApiKey() && !noRedirect) {
    clearApiKey();
    redirectToSignIn();
  }
  if (!response.ok) throw errorFromBody(response.status, await response.text());
  return response;
}

export async function apiJson(path, options = {}) {
  const response = await apiFetch(path, options);
  return response.status === 204 ? null : response.json();
}
