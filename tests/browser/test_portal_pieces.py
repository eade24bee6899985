"""The portal's own pieces, served by uvicorn with only the portal router:
routing and headers, the sign-in guard, and the SSE parser and chart code
running in Chromium (the parts the end-to-end tests cannot corner)."""

from __future__ import annotations

import httpx

PAGES = ["/portal/signin", "/portal/adapters", "/portal/playground", "/portal/usage"]


def test_pages_and_assets_are_served_locally_with_a_strict_policy(portal_only_url: str) -> None:
    with httpx.Client(base_url=portal_only_url) as client:
        assert client.get("/portal").headers["location"] == "/portal/adapters"
        for path in PAGES:
            response = client.get(path)
            assert response.status_code == 200, path
            assert response.headers["content-type"].startswith("text/html")
            assert "default-src 'self'" in response.headers["content-security-policy"]
            assert "http://" not in response.text and "https://" not in response.text, "no external assets"
            assert '<main id="main"' in response.text
        for asset in ["portal.css", "favicon.svg", "js/adapters.js", "js/sse.js", "js/charts.js"]:
            response = client.get(f"/portal/static/{asset}")
            assert response.status_code == 200, asset
            assert response.headers["cache-control"] == "no-cache", "unhashed assets are revalidated"
            again = client.get(f"/portal/static/{asset}", headers={"If-None-Match": response.headers["etag"]})
            assert again.status_code == 304
        assert client.get("/portal/static/js/sse.js").headers["content-type"].startswith("text/javascript")
        assert client.get("/portal/static/js/nope.js").status_code == 404
        assert client.get("/portal/static/../templates/base.html").status_code == 404
        assert client.get("/portal/static/%2e%2e/templates/base.html").status_code == 404


def test_pages_without_a_key_send_you_to_sign_in(portal_only_url: str, new_page) -> None:  # type: ignore[no-untyped-def]
    page, problems = new_page("desktop")
    page.goto(portal_only_url + "/portal/usage?start=2026-01-01&end=2026-01-31")
    page.wait_for_url("**/portal/signin?next=*")
    assert page.evaluate("new URLSearchParams(location.search).get('next')") == (
        "/portal/usage?start=2026-01-01&end=2026-01-31"
    )
    page.fill("#api-key", "sk-not-ours")
    page.click("#signin-submit")
    assert "lpx_" in page.locator("#signin-error").inner_text()
    assert page.evaluate("sessionStorage.length") == 0
    assert problems.messages == []


SSE_SCRIPT = """async (chunks) => {
  const { chatChunks, sseEvents } = await import('/portal/static/js/sse.js');
  const encoder = new TextEncoder();
  const body = () => new ReadableStream({ start(c) { for (const s of chunks) c.enqueue(encoder.encode(s)); c.close(); } });
  const events = [];
  for await (const e of sseEvents(body())) events.push(e);
  const deltas = [];
  for await (const chunk of chatChunks(body())) deltas.push(chunk.choices[0].delta.content);
  return { events, deltas };
}"""


def test_sse_parser_handles_split_reads_crlf_comments_and_done(portal_only_url: str, new_page) -> None:  # type: ignore[no-untyped-def]
    page, problems = new_page("desktop")
    page.goto(portal_only_url + "/portal/signin")
    stream = (
        ': keep-alive comment\n\n'
        'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
        'data: {"choices":[{"delta":{"content":"lo, "}}]}\r\n\r\n'
        'event: message\ndata: {"choices":[{"delta":\ndata: {"content":"wörld"}}]}\n\n'
        'data: [DONE]\n\n'
        'data: {"choices":[{"delta":{"content":"after done"}}]}\n\n'
    )
    encoded = stream.encode()
    # every split point, including inside the multi-byte "ö", must parse the same
    for cut in (1, 7, len(encoded) // 2, encoded.index("ö".encode()) + 1):
        pieces = [encoded[:cut], encoded[cut:]]
        result = page.evaluate(
            SSE_SCRIPT.replace("encoder.encode(s)", "new Uint8Array(s)"), [list(p) for p in pieces]
        )
        assert result["deltas"] == ["Hel", "lo, ", "wörld"], cut
        assert result["events"][2] == '{"choices":[{"delta":\n{"content":"wörld"}}]}'
        assert len(result["events"]) == 5
    assert problems.messages == []


def test_sse_parser_raises_the_error_event_message(portal_only_url: str, new_page) -> None:  # type: ignore[no-untyped-def]
    page, _ = new_page("desktop")
    page.goto(portal_only_url + "/portal/signin")
    message = page.evaluate("""async () => {
      const { chatChunks } = await import('/portal/static/js/sse.js');
      const text = 'data: {"choices":[{"delta":{"content":"a"}}]}\\n\\ndata: {"error":{"message":"engine overloaded"}}\\n\\n';
      const body = new ReadableStream({ start(c) { c.enqueue(new TextEncoder().encode(text)); c.close(); } });
      try { for await (const _ of chatChunks(body)) {} return null; } catch (e) { return e.message; }
    }""")
    assert message == "engine overloaded"


def test_chart_scale_and_bars(portal_only_url: str, new_page) -> None:  # type: ignore[no-untyped-def]
    page, problems = new_page("desktop")
    page.goto(portal_only_url + "/portal/signin")
    result = page.evaluate("""async () => {
      const charts = await import('/portal/static/js/charts.js');
      const scales = [0, 7, 130, 999, 12345].map((m) => charts.niceScale(m));
      const box = document.createElement('div');
      box.style.width = '600px';
      document.body.append(box);
      charts.stackedBarChart(box, {
        labels: ['d1', 'd2', 'd3'],
        series: [{ name: 'Input', values: [5, 0, 2] }, { name: 'Output', values: [1, 0, 3] }],
        formatValue: String, ariaLabel: 'Tokens per day',
      });
      const stacked = { bars: box.querySelectorAll('rect.bar').length, legend: box.querySelectorAll('.legend li').length,
                        label: box.querySelector('svg').getAttribute('aria-label') };
      charts.horizontalBarChart(box, { items: [{ label: 'a', value: 1 }, { label: 'b', value: 3 }, { label: 'c', value: 0 }],
                                       formatValue: String, ariaLabel: 'x' });
      const labels = [...box.querySelectorAll("text.tick-label")].map((t) => t.textContent);
      charts.horizontalBarChart(box, { items: [], formatValue: String, ariaLabel: 'x' });
      return { scales, stacked, labels, empty: box.textContent };
    }""")
    assert result["scales"] == [
        {"max": 1, "step": 0.25}, {"max": 8, "step": 2}, {"max": 150, "step": 50},
        {"max": 1000, "step": 500}, {"max": 15000, "step": 5000},
    ]
    assert result["stacked"] == {"bars": 4, "legend": 2, "label": "Tokens per day"}
    assert result["labels"] == ["b", "a"], "largest first; zero values left out"
    assert result["empty"] == "No data in this range."
    assert problems.messages == []
