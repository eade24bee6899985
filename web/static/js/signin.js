// Checks the pasted key against the API before keeping it.
import { ApiError, apiUrl, authHeaders, errorFromBody } from "./api.js";
import { clearError, showError } from "./dom.js";
import { getApiKey, root, setApiKey } from "./session.js";

const form = document.getElementById("signin-form");
const input = document.getElementById("api-key");
const errorEl = document.getElementById("signin-error");
const submit = document.getElementById("signin-submit");

function nextPage() {
  const next = new URLSearchParams(window.location.search).get("next");
  // only same-site portal paths, never an open redirect
  return next && next.startsWith(`${root}/portal/`) && !next.startsWith("//") ? next : `${root}/portal/adapters`;
}

// 401 is a bad key; any other answer (even 403 for a key without the
// inference scope) proves the key is live, and each page shows what it may do.
async function checkKey(key) {
  let response;
  try {
    response = await fetch(apiUrl("/v1/models"), { headers: authHeaders(key) });
  } catch {
    throw new ApiError(0, "Cannot reach the server. Check your connection and try again.");
  }
  if (response.status === 401) throw errorFromBody(401, await response.text());
  if (response.status >= 500) throw errorFromBody(response.status, await response.text());
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  clearError(errorEl);
  const key = input.value.trim();
  if (!key) {
    showError(errorEl, "Paste your API key.");
    input.focus();
    return;
  }
  if (!key.startsWith("lpx_")) {
    showError(errorEl, "API keys start with “lpx_”.");
    input.focus();
    return;
  }
  submit.disabled = true;
  submit.textContent = "Checking…";
  try {
    await checkKey(key);
    setApiKey(key);
    window.location.assign(nextPage());
  } catch (err) {
    const message = err.status === 401 ? `This key was not accepted: ${err.message}` : err.message;
    showError(errorEl, message);
    submit.disabled = false;
    submit.textContent = "Sign in";
  }
});

if (getApiKey()) window.location.replace(nextPage());
else input.focus();
