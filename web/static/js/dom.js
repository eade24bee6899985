// Small helpers shared by the pages: element creation and message areas.

// h("td", {class: "num"}, "12") -> <td class="num">12</td>; children are text or nodes.
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function showError(el, message) {
  el.textContent = message;
  el.hidden = !message;
}

export function clearError(el) {
  showError(el, "");
}
