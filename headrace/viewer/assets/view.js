"use strict";
// Every string from the run (prompts, completions, names) goes into the page as a text node:
// completions are untrusted model output and are never parsed as HTML.
(function () {
  const data = JSON.parse(document.getElementById("data").textContent);
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  };
  const fmt = (x, d = 3) => (typeof x === "number" ? (Number.isInteger(x) ? String(x) : x.toFixed(d)) : "–");
  const steps = data.steps;
  let current = steps.length ? steps[steps.length - 1].step : null;

  $("title").textContent = "headrace · " + data.run;
  $("config").textContent = Object.entries(data.config).map(([k, v]) => k + "=" + v).join("  ");

  function query() {
    const num = (id) => ($(id).value === "" ? null : Number($(id).value));
    return { text: $("search").value.trim().toLowerCase(), min: num("rmin"), max: num("rmax") };
  }
  function matches(s, q) {
    if (q.min !== null && !(s.reward !== null && s.reward >= q.min)) return false;
    if (q.max !== null && !(s.reward !== null && s.reward <= q.max)) return false;
    if (!q.text) return true;
    const hay = [s.prompt, s.completion].concat((s.turns || []).flatMap((t) => [t.observation, t.action]));
    return hay.some((h) => typeof h === "string" && h.toLowerCase().includes(q.text));
  }
  const filtering = (q) => q.text !== "" || q.min !== null || q.max !== null;

  // text with the search term wrapped in <mark>, built from text nodes only
  function highlighted(tag, cls, text, term) {
    const e = el(tag, cls);
    text = typeof text === "string" ? text : "";
    if (!term) { e.textContent = text; return e; }
    const lower = text.toLowerCase();
    let at = 0;
    for (let i = lower.indexOf(term); i !== -1; i = lower.indexOf(term, at)) {
      e.appendChild(document.createTextNode(text.slice(at, i)));
      e.appendChild(el("mark", null, text.slice(i, i + term.length)));
      at = i + term.length;
    }
    e.appendChild(document.createTextNode(text.slice(at)));
    return e;
  }

  function drawCurve() {
    const svg = $("curve");
    const pts = steps.filter((s) => typeof s.figures["reward/mean"] === "number");
    if (pts.length < 2) { svg.style.display = "none"; return; }
    const ys = pts.map((s) => s.figures["reward/mean"]);
    const lo = Math.min(...ys), hi = Math.max(...ys), span = hi - lo || 1;
    const x0 = pts[0].step, xs = pts[pts.length - 1].step - x0 || 1;
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", pts.map((s, i) =>
      ((s.step - x0) / xs * 196 + 2).toFixed(1) + "," + (56 - (ys[i] - lo) / span * 52).toFixed(1)).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", "#2f5bd3");
    line.setAttribute("stroke-width", "1.5");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.appendChild(line);
  }

  function drawSteps(q) {
    const list = $("steps");
    list.replaceChildren();
    const rewards = steps.map((s) => s.figures["reward/mean"]).filter((r) => typeof r === "number");
    const lo = Math.min(0, ...rewards), hi = Math.max(1, ...rewards);
    for (const s of steps) {
      const r = s.figures["reward/mean"];
      const n = s.samples.filter((x) => matches(x, q)).length;
      const li = el("li", s.step === current ? "current" : "");
      li.dataset.step = s.step;
      if (!s.samples.length) li.classList.add("empty");
      else if (filtering(q) && !n) li.classList.add("nomatch");
      li.appendChild(el("span", "n", "step " + s.step));
      const bar = el("span", "bar"), fill = el("i");
      fill.style.width = typeof r === "number" ? ((r - lo) / (hi - lo) * 100).toFixed(1) + "%" : "0";
      bar.appendChild(fill);
      li.appendChild(bar);
      li.appendChild(el("span", "r", fmt(r, 2) + (filtering(q) ? " (" + n + ")" : "")));
      li.addEventListener("click", () => select(s.step));
      list.appendChild(li);
    }
  }

  function drawSample(s, term) {
    const card = el("article", "sample " + (s.reward > 0 ? "pos" : "neg"));
    const meta = el("div", "meta");
    meta.appendChild(el("span", "reward", "reward " + fmt(s.reward)));
    if (s.advantage !== null && s.advantage !== undefined) meta.appendChild(el("span", "adv", "advantage " + fmt(s.advantage)));
    meta.appendChild(el("span", "version", "version " + s.policy_version));
    meta.appendChild(el("span", "stop", "stop: " + s.stop_reason + (s.episode_end && s.episode_end !== "done" ? " · episode: " + s.episode_end : "")));
    meta.appendChild(el("span", "where", "batch " + s.batch + " · group " + s.group + " · member " + s.member + " of " + s.group_size));
    meta.appendChild(el("span", "tokens", s.prompt_tokens + " prompt + " + s.completion_tokens + " completion tokens"));
    if (Array.isArray(s.group_rewards)) meta.appendChild(el("span", "group", "group rewards " + s.group_rewards.map((r) => fmt(r, 2)).join(" ")));
    card.appendChild(meta);
    const turns = s.turns && s.turns.length ? s.turns : [{ observation: s.prompt, action: s.completion }];
    turns.forEach((t, i) => {
      const many = turns.length > 1;
      card.appendChild(el("div", "label", many ? (i ? "turn " + (i + 1) + " observation" : "prompt") : "prompt"));
      card.appendChild(highlighted("pre", "prompt", t.observation, term));
      card.appendChild(el("div", "label", many ? "turn " + (i + 1) + " action" + (t.reward ? " · reward " + fmt(t.reward) : "") : "completion"));
      card.appendChild(highlighted("pre", "completion", t.action, term));
    });
    return card;
  }

  function drawPanel(q) {
    const s = steps.find((x) => x.step === current);
    const box = $("samples");
    box.replaceChildren();
    if (!s) { $("step-title").textContent = "no steps in this run yet"; return; }
    $("step-title").textContent = "step " + s.step;
    $("figures").textContent = Object.entries(s.figures).map(([k, v]) => k + " " + fmt(v)).join(" · ");
    const shown = s.samples.filter((x) => matches(x, q));
    $("count").textContent = shown.length + " of " + s.samples.length + " samples";
    if (!s.samples.length) box.appendChild(el("p", "none", "no samples were written for this step"));
    else if (!shown.length) box.appendChild(el("p", "none", "no sample of this step matches"));
    for (const x of shown) box.appendChild(drawSample(x, q.text));
  }

  function draw() { const q = query(); drawSteps(q); drawPanel(q); }
  function select(step) {
    current = step;
    try { history.replaceState(null, "", "#step=" + step); } catch (e) { /* some file:// setups refuse */ }
    draw();
  }

  // a link can open a step with a search and a reward range: #step=5&q=text&min=0.5&max=1
  const link = new URLSearchParams(location.hash.slice(1));
  if (steps.some((s) => String(s.step) === link.get("step"))) current = Number(link.get("step"));
  for (const [key, id] of [["q", "search"], ["min", "rmin"], ["max", "rmax"]]) if (link.has(key)) $(id).value = link.get(key);
  for (const id of ["search", "rmin", "rmax"]) $(id).addEventListener("input", draw);
  document.addEventListener("keydown", (e) => {
    if (e.target.tagName === "INPUT") return;
    const i = steps.findIndex((s) => s.step === current);
    if ((e.key === "j" || e.key === "ArrowDown") && i < steps.length - 1) select(steps[i + 1].step);
    if ((e.key === "k" || e.key === "ArrowUp") && i > 0) select(steps[i - 1].step);
  });
  drawCurve();
  draw();
  document.body.dataset.rendered = "yes";
})();
