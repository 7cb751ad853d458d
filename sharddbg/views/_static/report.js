// The standalone report's figures: each box (data-sd-figure) holds its figure's JSON beside it and is drawn by
// plotly.js once it comes near the screen, one figure per task, in page order. plotly.js is inlined as text and
// evaluated once, when the first figure is due, as a script of its own (after the page's first paint, so the
// text and the explorer are on screen and usable first). Each box says what it waits for (data-state: pending,
// queued, drawing, drawn, failed) until its figure replaces the message.
(function () {
  const boxes = [...document.querySelectorAll("[data-sd-figure]")];
  const CONFIG = { displaylogo: false, responsive: true };
  const say = (box, state, text) => {
    box.setAttribute("data-state", state);
    const p = box.querySelector(".sd-figure-pending");
    if (p) p.textContent = text;
  };
  let plotly = null;  // a promise of window.Plotly, made once
  function loadPlotly() {
    if (!plotly) {
      plotly = new Promise((resolve, reject) => {
        const source = document.getElementById("sd-plotly-js");
        const url = URL.createObjectURL(new Blob([source.textContent], { type: "text/javascript" }));
        const s = document.createElement("script");
        s.src = url;
        s.onload = () => {
          URL.revokeObjectURL(url);
          if (window.Plotly) resolve(window.Plotly); else reject(new Error("plotly.js did not define Plotly"));
        };
        s.onerror = () => reject(new Error("plotly.js could not be evaluated from this page"));
        document.head.append(s);
      });
    }
    return plotly;
  }
  const queue = [];
  let busy = false;
  const nextTask = () => new Promise((resolve) => setTimeout(resolve, 0));
  function pump() {
    if (busy || !queue.length) return;
    busy = true;
    const box = queue.shift();
    say(box, "drawing", plotly ? "drawing…" : "drawing… (plotly.js, the figures' library, is being loaded first)");
    loadPlotly()
      .then((Plotly) => nextTask().then(() => {
        const fig = JSON.parse(document.getElementById(box.id + "-data").textContent);
        return Plotly.newPlot(box, fig.data, fig.layout, CONFIG).then(() => {
          // a big trace's timeline carries its spans: any zoomed window is drawn span by span over it
          if (typeof _sdTimelineZoom !== "undefined") _sdTimelineZoom.attach(box, Plotly);  // the zoom script's global (a const)
        });
      }))
      .then(() => {
        const p = box.querySelector(".sd-figure-pending");
        if (p) p.remove();
        box.style.minHeight = "";
        box.setAttribute("data-state", "drawn");
      }, (err) => say(box, "failed", "this figure could not be drawn: " + (err && err.message ? err.message : err)))
      .then(() => { busy = false; setTimeout(pump, 0); });
  }
  function due(box) {
    if (box.getAttribute("data-state") !== "pending") return;
    queue.push(box);
    queue.sort((a, b) => boxes.indexOf(a) - boxes.indexOf(b));
    say(box, "queued", "waiting for the figures above it…");
    pump();
  }
  if (!("IntersectionObserver" in window)) { boxes.forEach(due); return; }
  // near the screen: within half a screen of it, so a figure is usually drawn by the time it is scrolled to
  const seen = new IntersectionObserver((entries) => {
    for (const e of entries) if (e.isIntersecting) { seen.unobserve(e.target); due(e.target); }
  }, { rootMargin: "50% 0px" });
  boxes.forEach((b) => seen.observe(b));
})();
