// miles dashboard: draws the overview's charts (and keeps them current with --follow) and colours
// the token row of a trajectory. Plain browser JS, no build step; Plotly is served by the app.
"use strict";
window.miles = (function () {
  const POLL_MS = 2000;
  const config = {responsive: true, displaylogo: false};

  function drawCharts(charts) {
    const box = document.getElementById("charts");
    const empty = document.getElementById("no-curves");
    if (empty) empty.hidden = charts.length > 0;
    for (const chart of charts) {
      let div = document.getElementById("chart-" + chart.id);
      const fresh = !div;
      if (fresh) {
        div = document.createElement("div");
        div.id = "chart-" + chart.id;
        div.className = "chart";
        box.appendChild(div);
      }
      Plotly.react(div, chart.data, chart.layout, config);
      if (fresh) {
        div.on("plotly_click", function (ev) {
          const p = ev.points && ev.points[0];
          if (p && p.data.meta && p.data.meta.run !== undefined) {
            location.href = "/run/" + p.data.meta.run + "/step/" + p.x;
          }
        });
      }
    }
  }

  function overview() {
    const initial = JSON.parse(document.getElementById("chart-data").textContent);
    let version = initial.version;
    drawCharts(initial.charts);
    if (document.body.dataset.follow !== "1") return;
    const live = document.getElementById("live");
    let busy = false;
    setInterval(async function () {
      if (busy) return;
      busy = true;
      try {
        const res = await fetch("/api/curves?v=" + encodeURIComponent(version), {cache: "no-store"});
        const body = await res.json();
        if (!res.ok) {
          live.textContent = body.error || ("error " + res.status);
          live.className = "live error";
          return;
        }
        if (!body.unchanged) {
          version = body.version;
          drawCharts(body.charts);
          const last = Object.entries(body.last_steps).map(([name, step]) => name + ": step " + step);
          live.textContent = "following · " + last.join(" · ") + " · updated " + new Date().toLocaleTimeString();
        }
      } catch (err) {
        live.textContent = "dashboard unreachable";
        live.className = "live error";
      } finally {
        busy = false;
      }
    }, POLL_MS);
  }

  // --- token colours: value -> background -------------------------------------------------
  function mix(t, from, to) {  // t in [0, 1]
    t = Math.max(0, Math.min(1, t));
    const c = from.map((f, i) => Math.round(f + (to[i] - f) * t));
    return "rgb(" + c.join(",") + ")";
  }
  const WHITE = [255, 255, 255], RED = [230, 60, 50], GREEN = [170, 225, 170], GREY = [215, 215, 215];
  const HUES = [[198, 219, 239], [253, 208, 162], [199, 233, 192], [218, 218, 235], [252, 187, 161], [217, 217, 217]];
  const MEASURES = {
    gap: {attr: "gap", colour: v => mix(v / 0.5, WHITE, RED), legend: "white = 0 … red ≥ 0.5 nats"},
    logprob: {attr: "lp", colour: v => mix(-v / 5, WHITE, RED), legend: "white = log-prob 0 … red ≤ −5"},
    version: {attr: "v", colour: v => "rgb(" + HUES[((v % HUES.length) + HUES.length) % HUES.length].join(",") + ")",
              legend: "one colour per weight version"},
    mask: {attr: "m", colour: v => (v >= 1 ? "rgb(" + GREEN.join(",") + ")" : "rgb(" + GREY.join(",") + ")"),
           legend: "green = trained (mask 1), grey = not trained"},
  };

  function colourTokens(name) {
    const m = MEASURES[name];
    const spans = document.querySelectorAll("#tokens .tok");
    for (const s of spans) {
      const raw = s.dataset[m.attr];
      s.style.backgroundColor = raw === "" || raw === undefined ? "transparent" : m.colour(parseFloat(raw));
    }
    document.getElementById("legend").textContent = m.legend;
  }

  function trajectory() {
    const select = document.getElementById("measure");
    colourTokens(select.value);
    select.addEventListener("change", () => colourTokens(select.value));
  }

  function timeline() {
    const tl = document.getElementById("timeline-data");
    if (tl && window.Plotly) {
      const traces = JSON.parse(tl.textContent);
      Plotly.newPlot("timeline", traces, {
        height: Math.min(600, 80 + 24 * traces[0].y.length), margin: {l: 260, r: 10, t: 10, b: 36},
        xaxis: {title: {text: "seconds since the episode started"}}, yaxis: {autorange: "reversed"},
        showlegend: false}, config);
    }
  }

  return {overview, trajectory, timeline, colourTokens};
})();
