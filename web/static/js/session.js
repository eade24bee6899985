// The tenant's API key lives in sessionStorage: it survives reloads and page
// changes inside this tab, and is gone when the tab closes.
const KEY_NAME = "loraplex.apiKey";

export const root = document.querySelector('meta[name="lpx-root"]')?.content ?? "";

export function getApiKey() {
  return sessionStorage.getItem(KEY_NAME);
}

export function setApiKey(key) {
  sessionStorage.setItem(KEY_NAME, key);
}

export function signOut() {
  clearApiKey();
  window.location.assign(`${root}/portal/signin`);
}

export function clearApiKey() {
  sessionStorage.removeItem(KEY_NAME);
}

export function redirectToSignIn() {
  const next = window.location.pathname + window.location.search;
  window.location.assign(`${root}/portal/signin?next=${encodeURIComponent(next)}`);
}

// Every page but sign-in calls this first: no key, no page.
export function requireApiKey() {
  const key = getApiKey();
  if (!key) {
    redirectToSignIn();
    return null;
  }
  const hint = document.getElementById("key-hint");
  if (hint) hint.textContent = `${key.slice(0, 12)}…`;
  document.getElementById("sign-out")?.addEventListener("click", signOut);
  return key;
}
