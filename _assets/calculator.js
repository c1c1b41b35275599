/* The calculators page: labsupport.estimate's Python, run by Pyodide in a worker thread.
 *
 * No number is computed here: every answer comes from labsupport.estimate.web.call (in
 * Python), and this file only starts Python, reads the forms and draws the answers.
 *
 * Python runs in a dedicated Web Worker, not on the page's main thread: starting it takes
 * seconds of CPU and a planner search up to a second, and on the main thread the page
 * would not scroll, type or click meanwhile. The page asks the worker by message, each
 * request with an id its answer carries back; a form's answer that newer input has
 * superseded is not drawn (and the worker skips computing it, if it has not started).
 *
 * Chromium refuses fetch() and module scripts from file:// URLs, and the site must work
 * from a folder too. So tools/site_calculator.py ships every file Pyodide needs as a
 * classic script that stores it in self.calculatorData; this file starts a module worker
 * from a data: URL (the function `worker` below; Chromium allows that from a folder) and
 * posts it those files. The worker imports Pyodide's loader and runtime module from blob:
 * URLs, serves Pyodide's two fetches (the WebAssembly binary, the standard library) from
 * the files and hands Pyodide the lock file's contents. One path, from a folder and from a
 * server alike.
 */
(() => {
  const here = document.currentScript.src;
  const status = () => document.querySelectorAll(".calc-status");

  function say(text, state) {
    for (const el of status()) {
      el.textContent = text;
      el.dataset.state = state;
    }
  }

  // The worker's code: turned into text (worker.toString()), never run in the page. It
  // answers {id, start} by starting Python, then each {id, name, args, key} with web.call's
  // answer, in order; a request whose key a later queued request shares is skipped
  // (answered {id, superseded}). An exception comes back as {id, thrown: its message}.
  function worker() {
    function bytes(b64) {
      if (Uint8Array.fromBase64) return Uint8Array.fromBase64(b64);
      const text = atob(b64);
      const out = new Uint8Array(text.length);
      for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
      return out;
    }

    async function start({ indexURL, data }) {
      const served = {
        [indexURL + "pyodide.asm.wasm"]: ["pyodide.asm.wasm", "application/wasm"],
        [indexURL + "python_stdlib.zip"]: ["python_stdlib.zip", "application/zip"],
      };
      const fetchOriginal = self.fetch;
      self.fetch = (input, init) => {
        const file = served[input instanceof Request ? input.url : String(input)];
        if (!file) return fetchOriginal(input, init);
        const headers = { "Content-Type": file[1] };
        return Promise.resolve(new Response(bytes(data[file[0]]), { headers }));
      };
      const modules = ["pyodide.mjs", "pyodide.asm.mjs"].map((name) =>
        URL.createObjectURL(new Blob([data[name]], { type: "text/javascript" })));
      let pyodide;
      try {
        const [{ loadPyodide }, { default: createPyodideModule }] = await Promise.all(
          modules.map((url) => import(url)));
        pyodide = await loadPyodide({
          indexURL, createPyodideModule, lockFileContents: data["pyodide-lock.json"],
        });
      } finally {
        self.fetch = fetchOriginal;
        for (const url of modules) URL.revokeObjectURL(url);
      }
      for (const [path, source] of Object.entries(data.labsupport)) {
        const full = `/home/pyodide/site/${path}`;
        pyodide.FS.mkdirTree(full.slice(0, full.lastIndexOf("/")));
        pyodide.FS.writeFile(full, source);
      }
      pyodide.runPython("import sys; sys.path.insert(0, '/home/pyodide/site')");
      return pyodide.pyimport("labsupport.estimate.web").call;
    }

    let started, call;
    const queue = [];
    let working = false;
    function work() {
      const request = queue.shift();
      try {
        if (request.key && queue.some((r) => r.key === request.key)) {
          self.postMessage({ id: request.id, superseded: true });
        } else {
          self.postMessage({ id: request.id, reply: JSON.parse(call(request.name, request.args)) });
        }
      } catch (error) {
        self.postMessage({ id: request.id, thrown: error.message });
      }
      // a task each, so that the requests posted meanwhile are queued before the next
      if (queue.length) setTimeout(work, 0);
      else working = false;
    }
    self.onmessage = ({ data: message }) => {
      if (message.start) {
        started = start(message.start).then((f) => {
          call = f;
          self.postMessage({ id: message.id });
        }, (error) => self.postMessage({ id: message.id, thrown: error.message }));
        return;
      }
      queue.push(message);
      if (!working) {
        working = true;
        started.then(() => setTimeout(work, 0));
      }
    };
  }

  // Python in a worker, started; returns ask(name, args, key): a promise of web.call's
  // answer ({result} or {error}), or of null where a newer request with the same key
  // superseded it before it ran.
  async function startPython() {
    const data = self.calculatorData || {};
    const needed = ["pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip",
      "pyodide-lock.json", "labsupport"];
    const missing = needed.filter((name) => !(name in data));
    if (missing.length) {
      throw new Error(`the page could not load Python (Pyodide): missing ${missing.join(", ")}`);
    }
    // A module worker (Pyodide refuses classic ones) from a data: URL: in a page opened
    // from a folder, Chromium refuses a module worker from a blob: URL.
    const source = `(${worker})();\n`;
    const thread = new Worker(`data:text/javascript;charset=utf-8,${encodeURIComponent(source)}`,
      { type: "module", name: "calculator: Python" });
    const waiting = new Map();
    let last = 0;
    const post = (message) => new Promise((resolve, reject) => {
      const id = ++last;
      waiting.set(id, { resolve, reject });
      thread.postMessage({ ...message, id });
    });
    thread.onmessage = ({ data: answer }) => {
      const { resolve, reject } = waiting.get(answer.id);
      waiting.delete(answer.id);
      if ("thrown" in answer) reject(new Error(answer.thrown));
      else resolve(answer.superseded ? null : answer.reply);
    };
    thread.onerror = (event) => {  // the worker's script itself failed
      for (const { reject } of waiting.values()) {
        reject(new Error(`Python's worker failed: ${event.message || "no reason given"}`));
      }
      waiting.clear();
    };
    performance.mark("calculator: scripts loaded");
    const files = Object.fromEntries(needed.map((name) => [name, data[name]]));
    await post({ start: { indexURL: new URL("calculator/", here).href, data: files } });
    performance.mark("calculator: labsupport imported");
    return (name, args, key) => post({ name, args: JSON.stringify(args), key });
  }

  // ------------------------------------------------------------------ forms and drawing

  const GB = 1e9;
  const gb = (x) => (x / GB).toFixed(2);
  const el = (tag, attrs = {}, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    node.append(...children);
    return node;
  };

  function values(form) {
    const out = {};
    for (const input of form.elements) {
      if (!input.name) continue;
      if (input.type === "checkbox") out[input.name] = input.checked;
      else if (input.type === "number") out[input.name] = Number(input.value);
      else out[input.name] = input.value;
    }
    return out;
  }

  function bar(share, label) {
    const width = Math.min(100, Math.max(0, 100 * share));
    return el("div", { class: "calc-bar", role: "img", "aria-label": label },
      el("div", { class: share > 1 ? "calc-fill calc-over" : "calc-fill", style: `width: ${width}%` }));
  }

  function answer(out, reply) {
    out.replaceChildren();
    if (reply.error) {
      out.append(el("p", { class: "calc-error", role: "alert" }, reply.error));
      return null;
    }
    return reply.result;
  }

  function drawMemory(out, reply, gpu) {
    const r = answer(out, reply);
    if (!r) return;
    const rows = Object.entries(r.parts).map(([part, b]) => el("tr", {},
      el("th", { scope: "row" }, part),
      el("td", { "data-part": part }, gb(b)),
      el("td", {}, bar(b / r.device, `${part}: ${(100 * b / r.device).toFixed(0)} % of the GPU`))));
    const c = r.custom;  // a custom model: its FFN width and key-value heads, defaults filled in
    const shape = c ? ` (${c.family === "llama" ? "Llama" : "GPT"}, FFN width ` +
      `${c.ffn.toLocaleString("en")}, ${c.kv_heads} key-value heads)` : "";
    const total = el("tr", { class: "calc-total" }, el("th", { scope: "row" }, "total"),
      el("td", { "data-part": "total" }, gb(r.total)),
      el("td", {}, bar(r.total / r.device, `total: ${(100 * r.total / r.device).toFixed(0)} % of the GPU`)));
    out.append(
      el("p", { class: r.fits ? "calc-verdict calc-fits" : "calc-verdict calc-nofit", "data-fits": r.fits },
        `${gb(r.total)} GB per GPU of the ${gpu}'s ${gb(r.device)} GB: ` +
        (r.fits ? "fits" : "does not fit") + ` (the planner allows ${gb(r.usable)} GB).`),
      el("table", { class: "calc-table" },
        el("thead", {}, el("tr", {}, el("th", {}, "state"), el("th", {}, "GB"), el("th", {}, "of the GPU"))),
        el("tbody", {}, ...rows, total)),
      el("p", { class: "calc-note" },
        `${(r.params_total / 1e9).toFixed(2)} B parameters${shape}; the heaviest pipeline stage ` +
        `(stage ${r.stage + 1}) holds ${r.stage_layers} layers and this GPU ` +
        `${(r.params_per_gpu / 1e9).toFixed(3)} B of its parameters; ` +
        `${r.gpus.toLocaleString("en")} GPUs in all.`));
  }

  // dp×tp×pp, with context and expert parallelism where they are above 1
  const axesText = ([dp, tp, cp, pp, ep]) =>
    `${dp}×${tp}×${pp}` + (cp > 1 ? `, CP ${cp}` : "") + (ep > 1 ? `, EP ${ep}` : "");
  const percent = (x) => `${(100 * x).toFixed(1)} %`;

  function drawPlan(out, reply, chosen, pick, efficiency) {
    const r = answer(out, reply);
    if (!r) return;
    const head = ["", "dp×tp×pp", "ZeRO", "micro-batch", "chunks", "recompute", "GB", "step s", "TFLOP/s", "MFU"];
    const rows = r.rows.map((row, i) => {
      const l = row.layout;
      const button = el("button", { type: "button", "aria-pressed": String(i === chosen),
        "aria-label": `show layout ${i + 1}` }, String(i + 1));
      button.addEventListener("click", () => pick(i));
      const mesh = axesText(row.axes);
      return el("tr", { class: i === chosen ? "calc-chosen" : "", "data-row": i },
        el("td", {}, button), el("td", { "data-key": "mesh" }, mesh),
        el("td", {}, String(l.zero)), el("td", {}, String(l.micro_batch)), el("td", {}, String(l.chunks)),
        el("td", {}, l.recompute), el("td", { "data-key": "memory" }, gb(row.memory)),
        el("td", { "data-key": "step_s" }, row.step_s.toFixed(2)),
        el("td", { "data-key": "tflops" }, row.tflops.toFixed(1)),
        el("td", {}, `${(100 * row.mfu).toFixed(0)} %`));
    });
    const published = r.published_axes
      ? `The published mesh ${axesText(r.published_axes)} ranks ${r.published_rank ?? "nowhere (no layout of it fits)"}. `
      : "";
    const narrowed = Object.entries(r.narrowed);
    const searched = narrowed.length
      ? ` For this model the page searches only ${narrowed.map(([k, v]) => `${k} ${v.join(", ")}`).join("; ")}` +
        " (the full search takes several seconds in a browser; every mesh near the top of it has these)."
      : "";
    out.append(el("p", { class: "calc-note" },
      `${r.feasible.toLocaleString("en")} layouts fit on ${r.gpus.toLocaleString("en")} ${r.gpu}; ` +
      `${r.meshes} meshes, the best of each below, fastest first. ${published}` +
      `Step times assume the efficiency fitted to published runs: GEMMs at ${percent(efficiency.gemm)} ` +
      `of the dense peak, the other kernels' activations through memory ${efficiency.passes} times ` +
      `(chapter 13).${searched}`),
      el("div", { class: "calc-scroll", tabindex: "0", role: "region", "aria-label": "ranked layouts" },
        el("table", { class: "calc-table" },
          el("thead", {}, el("tr", {}, ...head.map((h) => el("th", { scope: "col" }, h)))),
          el("tbody", {}, ...rows))));
    const row = r.rows[chosen];
    if (!row) return;
    const step = row.step_s;
    const parts = Object.entries(row.parts).map(([part, s]) => el("tr", {},
      el("th", { scope: "row" }, part), el("td", { "data-part": part }, s.toFixed(3)),
      el("td", {}, bar(s / step, `${part}: ${(100 * s / step).toFixed(0)} % of the step`))));
    const memory = [["states", row.states], ["activations", row.activations]].map(([part, b]) =>
      el("tr", {}, el("th", { scope: "row" }, part), el("td", { "data-part": part }, gb(b)),
        el("td", {}, bar(b / r.device, `${part}: ${(100 * b / r.device).toFixed(0)} % of the GPU`))));
    out.append(el("h4", {}, `Layout ${chosen + 1}: where the step goes`),
      el("table", { class: "calc-table calc-breakdown" },
        el("thead", {}, el("tr", {}, el("th", {}, "part"), el("th", {}, "seconds"), el("th", {}, "of the step"))),
        el("tbody", {}, ...parts)),
      el("table", { class: "calc-table calc-breakdown" },
        el("thead", {}, el("tr", {}, el("th", {}, "memory"), el("th", {}, "GB"), el("th", {}, "of the GPU"))),
        el("tbody", {}, ...memory)));
  }

  // One form's output: ask(args) draws its answer, unless a newer ask has been made since
  // (then the newer one draws). While an answer is awaited the output is aria-busy.
  function live(out, call, key, draw) {
    let latest = 0;
    return async (args) => {
      const ticket = ++latest;
      out.setAttribute("aria-busy", "true");
      const reply = await call(key, args, key);
      if (ticket !== latest) return;
      out.removeAttribute("aria-busy");
      draw(reply);
    };
  }

  async function wire(call) {
    const presets = (await call("presets", {})).result;
    for (const fieldset of document.querySelectorAll(".calc-form fieldset")) fieldset.disabled = false;
    const first = [];
    const memoryForm = document.getElementById("calc-memory-form");
    if (memoryForm) {
      const out = document.getElementById("calc-memory-out");
      const custom = presets.custom.map((n) => memoryForm.elements[n]);
      const fill = () => {  // a preset's sizes, shown but fixed; 0 (the default) as empty
        const model = presets.models[memoryForm.elements.model.value];
        for (const input of custom) {
          input.disabled = Boolean(model);
          if (model) input.value = model[input.name] || "";
        }
        if (model) memoryForm.elements.seq_len.value = model.seq_len;
        // a model with a published run: its layout as published
        const layout = presets.layouts[memoryForm.elements.model.value] || {};
        for (const [name, value] of Object.entries(layout)) {
          const input = memoryForm.elements[name];
          if (name === "model" || !input) continue;
          if (input.type === "checkbox") input.checked = value;
          else input.value = value;
        }
      };
      const ask = live(out, call, "memory", (reply) => drawMemory(out, reply, memoryForm.elements.gpu.value));
      const update = () => ask(values(memoryForm));
      memoryForm.addEventListener("input", (e) => {
        if (e.target.name === "model") fill();
        update();
      });
      fill();
      memoryForm.addEventListener("submit", (e) => { e.preventDefault(); update(); });
      first.push(update());
    }
    const planForm = document.getElementById("calc-plan-form");
    if (planForm) {
      const out = document.getElementById("calc-plan-out");
      let chosen = 0;
      let shown = null;  // the answer drawn, redrawn when another layout is chosen
      let focus = null;  // the row whose button takes the focus once drawn
      const draw = (reply) => {
        shown = reply;
        drawPlan(out, reply, chosen, pick, presets.efficiency);
        if (focus !== null) out.querySelector(`[data-row="${focus}"] button`)?.focus();
        focus = null;
      };
      const pick = (i) => {  // the answer drawn again, or the one awaited, with layout i
        chosen = focus = i;
        if (!out.hasAttribute("aria-busy")) draw(shown);
      };
      const ask = live(out, call, "plan", draw);
      const update = () => ask(values(planForm));
      const preset = () => {  // a published run on this model and cluster: its batch and settings
        const run = presets.published.find((p) => p.model === planForm.elements.model.value &&
          p.cluster === planForm.elements.cluster.value);
        if (!run) return;
        for (const name of ["global_batch", "cp", "framework"]) planForm.elements[name].value = run[name];
        planForm.elements.dp_overlap.checked = run.dp_overlap;
      };
      planForm.addEventListener("input", (e) => {
        if (e.target.name === "model" || e.target.name === "cluster") preset();
        if (e.target.name === "framework") {  // the framework's own overlap, until changed
          planForm.elements.dp_overlap.checked = presets.frameworks[e.target.value].dp_overlap;
        }
        chosen = 0;
        update();
      });
      planForm.addEventListener("submit", (e) => { e.preventDefault(); update(); });
      first.push(update());
    }
    await Promise.all(first);
  }

  async function main() {
    const started = performance.now();
    say("Loading the calculator: Python (Pyodide) is starting in this page…", "loading");
    try {
      await wire(await startPython());
      performance.mark("calculator: first answers drawn");
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      say(`Live: computed in this page by labsupport.estimate (Python, started in ${seconds} s).`, "ready");
      document.documentElement.dataset.calculator = "ready";
    } catch (error) {
      say(`The calculator is off: ${error.message}. The tables below were computed when the ` +
        "site was built.", "off");
      document.documentElement.dataset.calculator = "off";
    }
  }

  if (document.readyState === "complete") main();
  else window.addEventListener("load", main);
})();
