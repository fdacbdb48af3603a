// mas-trainer view: renders the JSON in #mt-data. Every string from the run is put into the
// page as text (textContent, createTextNode, attribute values); nothing is parsed as HTML.
(function () {
  'use strict';
  const DATA = JSON.parse(document.getElementById('mt-data').textContent);
  const INDEX = DATA.index;
  const STEPS = DATA.steps_data || {};
  const SVGNS = 'http://www.w3.org/2000/svg';
  const PALETTE = ['#0969da', '#cf222e', '#1a7f37', '#8250df', '#bf8700', '#0598bc', '#e16f24', '#6e7781', '#bf3989', '#4d2d00'];
  const state = { step: null, group: 0, rollout: -1, colour: 'logprob' };
  const pending = {};

  // --- tiny DOM helpers --------------------------------------------------------------------------
  function el(tag, props, children) {
    const node = document.createElement(tag);
    setProps(node, props);
    append(node, children);
    return node;
  }
  function svg(tag, attrs, children) {
    const node = document.createElementNS(SVGNS, tag);
    for (const k in (attrs || {})) node.setAttribute(k, String(attrs[k]));
    append(node, children);
    return node;
  }
  function setProps(node, props) {
    for (const k in (props || {})) {
      const v = props[k];
      if (v === null || v === undefined || v === false) continue;
      if (k === 'class') node.className = v;
      else if (k === 'text') node.textContent = String(v);
      else if (k === 'onclick' || k === 'onchange') node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, String(v));
    }
  }
  function append(node, children) {
    if (children === null || children === undefined) return;
    if (!Array.isArray(children)) children = [children];
    for (const c of children) {
      if (c === null || c === undefined || c === false) continue;
      node.appendChild(typeof c === 'string' || typeof c === 'number' ? document.createTextNode(String(c)) : c);
    }
  }
  function num(v) {
    if (typeof v === 'number') return v;
    if (v === 'NaN' || v === 'Infinity' || v === '-Infinity') return Number(v);
    return null;
  }
  function fmt(v, digits) {
    const x = num(v);
    if (x === null) return '—';
    if (!isFinite(x)) return String(x);
    const d = digits === undefined ? 3 : digits;
    if (x !== 0 && Math.abs(x) < Math.pow(10, -d)) return x.toExponential(1);
    return (Math.round(x * Math.pow(10, d)) / Math.pow(10, d)).toString();
  }
  function signed(v) { const x = num(v); return x === null ? '—' : (x > 0 ? '+' : '') + fmt(x); }
  function asText(v) {
    if (v === null || v === undefined) return '';
    if (typeof v === 'string') return v;
    try { return JSON.stringify(v, null, 2); } catch (e) { return String(v); }
  }
  function short(v, n) { const s = asText(v).replace(/\s+/g, ' '); return s.length > n ? s.slice(0, n - 1) + '…' : s; }
  function badge(text, cls, title) { return el('span', { class: 'badge ' + (cls || ''), text: text, title: title }); }
  function section(title, children) { return el('div', { class: 'section' }, [el('h4', { text: title })].concat(children)); }
  function kv(pairs) {
    const box = el('div', { class: 'kv' });
    for (const [k, v] of pairs) { append(box, [el('span', { class: 'k', text: k }), el('span', {}, v)]); }
    return box;
  }
  function table(headers, rows) {
    const t = el('table');
    t.appendChild(el('tr', {}, headers.map((h) => el('th', { text: h }))));
    for (const r of rows) t.appendChild(el('tr', {}, r.map((c) => (c instanceof Node ? c : el('td', { text: c === null || c === undefined ? '' : String(c) })))));
    return t;
  }
  function numCell(v, f) { return el('td', { class: 'num', text: (f || fmt)(v) }); }

  // --- state in the address (#step=..&group=..&rollout=..&colour=..) ------------------------------
  function readHash() {
    const p = new URLSearchParams(location.hash.slice(1));
    const names = INDEX.steps.map((s) => s.name);
    if (names.includes(p.get('step'))) state.step = p.get('step');
    // group=N is the number the page shows in its groups table ("#" column, "Task N"): 1-based
    const g = parseInt(p.get('group'), 10); if (g >= 1 && g <= 100000) state.group = g - 1;
    const r = parseInt(p.get('rollout'), 10); if (r >= -1 && r < 100000) state.rollout = r;
    if (['logprob', 'advantage', 'reward'].includes(p.get('colour'))) state.colour = p.get('colour');
  }
  function writeHash() {
    const p = new URLSearchParams({ step: state.step || '', group: String(state.group + 1), rollout: String(state.rollout), colour: state.colour });
    history.replaceState(null, '', '#' + p.toString());
  }

  // --- header, policy map, settings ----------------------------------------------------------------
  function renderOverview(root) {
    document.getElementById('source').textContent = INDEX.source + (INDEX.kind === 'run' ? ' (run directory)' : ' (trajectories file)');
    document.title = 'mas-trainer view · ' + INDEX.title;
    const box = el('section', { id: 'overview' });
    for (const n of INDEX.notes || []) box.appendChild(el('div', { class: 'note', text: n }));
    for (const w of INDEX.warnings || []) box.appendChild(el('div', { class: 'note warn', text: w }));
    const app = INDEX.app;
    if (app && app.roles) {
      box.appendChild(el('h2', { text: 'Roles and policies' }));
      const roleName = app.role_names || {};
      const rows = Object.keys(app.roles).sort().map((node) => {
        const pol = app.roles[node];
        const rec = (app.policies || {})[pol] || {};
        return [node, roleName[node] || node, pol, rec.base_model || '', rec.trainable === false ? 'frozen' : 'trained'];
      });
      for (const node of app.frozen || []) rows.push([node, node, 'frozen', ((app.policies || {}).frozen || {}).base_model || '', 'frozen']);
      box.appendChild(table(['node', 'role', 'policy', 'base model', ''], rows));
    }
    const rc = INDEX.reward_config;
    const ac = INDEX.advantage_config || {};
    if (rc || Object.keys(ac).length) {
      const pairs = [];
      if (rc) {
        pairs.push(['allocator', rc.allocator]);
        pairs.push(['level weights', Object.keys(rc.weights || {}).map((k) => k + ' ' + fmt(rc.weights[k])).join(', ')]);
        if (rc.options && Object.keys(rc.options).length) pairs.push(['allocator options', asText(rc.options)]);
        pairs.push(['failed rollouts', String(rc.on_failure)]);
      }
      for (const p of Object.keys(ac)) pairs.push(['advantages of ' + p, ac[p].estimator + (ac[p].rollout_norm ? ', rollout_norm' : '')]);
      box.appendChild(el('h3', { text: 'Rewards and advantages' }));
      box.appendChild(kv(pairs));
    }
    if (DATA.api && INDEX.raw_files && INDEX.raw_files.length) {
      const links = el('div', { class: 'muted' }, 'files: ');
      INDEX.raw_files.forEach((f, i) => {
        if (i) links.appendChild(document.createTextNode(' · '));
        links.appendChild(el('a', { href: 'raw/' + f.split('/').map(encodeURIComponent).join('/'), text: f }));
      });
      box.appendChild(links);
    }
    root.appendChild(box);
  }

  // --- charts --------------------------------------------------------------------------------------
  function niceTicks(lo, hi, n) {
    const span = hi - lo;
    const step0 = Math.pow(10, Math.floor(Math.log10(span / n)));
    const err = (n * step0) / span;
    const step = step0 * (err <= 0.15 ? 10 : err <= 0.35 ? 5 : err <= 0.75 ? 2 : 1);
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }
  function colourKey(name) { return name.replace(/ \((train|held-out)\)$/, ''); }
  function chart(c) {
    const W = 464, H = 210, L = 52, R = 10, T = 8, B = 30;
    const pts = [].concat(...c.series.map((s) => s.points));
    let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
    let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 0.5; y0 -= d; y1 += d; } else { const d = (y1 - y0) * 0.06; y0 -= d; y1 += d; }
    const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    const g = svg('svg', { width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: 'chart-svg', role: 'img' });
    g.appendChild(svg('title', {}, c.title));
    for (const v of niceTicks(y0, y1, 5)) {
      g.appendChild(svg('line', { x1: L, x2: W - R, y1: Y(v), y2: Y(v), stroke: '#eaeef2' }));
      g.appendChild(svg('text', { x: L - 4, y: Y(v) + 4, 'text-anchor': 'end', 'font-size': 10, fill: '#667085' }, fmt(v, 3)));
    }
    const xt = niceTicks(x0, x1, Math.min(6, Math.max(1, x1 - x0))).filter((v) => Number.isInteger(v) || x1 - x0 < 3);
    for (const v of xt) {
      g.appendChild(svg('line', { x1: X(v), x2: X(v), y1: H - B, y2: H - B + 4, stroke: '#8c959f' }));
      g.appendChild(svg('text', { x: X(v), y: H - B + 15, 'text-anchor': 'middle', 'font-size': 10, fill: '#667085' }, fmt(v, 2)));
    }
    g.appendChild(svg('line', { x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: '#8c959f' }));
    g.appendChild(svg('line', { x1: L, x2: L, y1: T, y2: H - B, stroke: '#8c959f' }));
    g.appendChild(svg('text', { x: (L + W - R) / 2, y: H - 2, 'text-anchor': 'middle', 'font-size': 10, fill: '#667085' }, 'step'));
    const keys = [];
    const legend = el('div', { class: 'legend' });
    for (const s of c.series) {
      const key = colourKey(s.name);
      if (!keys.includes(key)) keys.push(key);
      const colour = PALETTE[keys.indexOf(key) % PALETTE.length];
      const sorted = s.points.slice().sort((a, b) => a[0] - b[0]);
      const line = svg('polyline', { points: sorted.map((p) => X(p[0]).toFixed(1) + ',' + Y(p[1]).toFixed(1)).join(' '),
        fill: 'none', stroke: colour, 'stroke-width': 1.8, class: 'series ' + s.style });
      if (s.style === 'val') line.setAttribute('stroke-dasharray', '5 3');
      g.appendChild(line);
      for (const p of sorted) {
        g.appendChild(svg('circle', { cx: X(p[0]), cy: Y(p[1]), r: s.style === 'val' ? 3 : 2.2, fill: s.style === 'val' ? '#fff' : colour, stroke: colour },
          svg('title', {}, s.name + ' · step ' + fmt(p[0], 2) + ': ' + fmt(p[1], 4))));
      }
      legend.appendChild(el('span', {}, [el('span', { class: 'sw' + (s.style === 'val' ? ' dashed' : '') }), s.name]));
      legend.lastChild.firstChild.style.borderTopColor = colour;
    }
    return el('div', { class: 'chart', 'data-chart': c.id }, [el('div', { class: 'title', text: c.title }), g, legend]);
  }
  function renderCharts(root) {
    const box = el('section', { id: 'curves' }, el('h2', { text: 'Curves' }));
    if (!INDEX.charts.length) box.appendChild(el('div', { class: 'muted', text: 'no metrics rows (metrics.jsonl) to plot' }));
    box.appendChild(el('div', { class: 'charts' }, INDEX.charts.map(chart)));
    if (INDEX.more_charts.length) {
      const more = el('details', { id: 'more-metrics' }, el('summary', { text: 'more metrics (' + INDEX.more_charts.length + ' charts: losses, KL, grad norm, advantages, speed, ...)' }));
      let drawn = false;
      more.addEventListener('toggle', () => {
        if (more.open && !drawn) { drawn = true; more.appendChild(el('div', { class: 'charts' }, INDEX.more_charts.map(chart))); }
      });
      box.appendChild(more);
    }
    root.appendChild(box);
  }

  // --- rollouts ------------------------------------------------------------------------------------
  function stepLabel(s) {
    const kind = s.kind === 'val' ? 'held-out' : s.kind === 'train' ? 'training' : s.kind === 'forks' ? 'forked continuations' : 'trajectories';
    const at = s.step === null || s.step === undefined ? s.name : 'step ' + s.step;
    return at + ' · ' + kind + ' · ' + s.rollouts + ' rollouts' + (s.mean_reward !== null && s.mean_reward !== undefined ? ' · reward ' + fmt(s.mean_reward) : '') +
      (s.errors ? ' · ' + s.errors + ' failed' : '');
  }
  function loadStep(name) {
    if (STEPS[name]) return Promise.resolve(STEPS[name]);
    if (!DATA.api) return Promise.resolve(null);
    if (!pending[name]) {
      pending[name] = fetch('api/step?name=' + encodeURIComponent(name), { credentials: 'same-origin' })
        .then((r) => { if (!r.ok) throw new Error('HTTP ' + r.status); return r.json(); })
        .then((d) => { STEPS[name] = d; return d; })
        .finally(() => { delete pending[name]; });
    }
    return pending[name];
  }
  function renderRolloutsSection(root) {
    const box = el('section', { id: 'rollouts' }, el('h2', { text: 'Rollouts' }));
    if (!INDEX.steps.length) { box.appendChild(el('div', { class: 'muted', text: 'no trajectory files yet' })); root.appendChild(box); return; }
    const select = el('select', { id: 'step-select', onchange: () => { state.step = select.value; state.group = 0; state.rollout = -1; showStep(); } });
    for (const s of INDEX.steps) select.appendChild(el('option', { value: s.name, text: stepLabel(s) }));
    const colour = el('select', { id: 'colour-select', onchange: () => { state.colour = colour.value; showStep(); } });
    for (const [v, t] of [['logprob', 'log-prob'], ['advantage', 'advantage'], ['reward', 'allocated reward']]) colour.appendChild(el('option', { value: v, text: t }));
    box.appendChild(el('div', { class: 'controls' }, [el('label', {}, ['trajectory file ', select]), el('label', {}, ['colour tokens by ', colour]), el('span', { id: 'scale' })]));
    box.appendChild(el('div', { id: 'step-body' }));
    root.appendChild(box);
  }
  function showStep() {
    writeHash();
    document.getElementById('step-select').value = state.step;
    document.getElementById('colour-select').value = state.colour;
    const body = document.getElementById('step-body');
    body.textContent = '';
    body.appendChild(el('div', { class: 'muted', text: 'loading ' + state.step + ' …' }));
    const want = state.step;
    loadStep(want).then((step) => {
      if (want !== state.step) return;
      body.textContent = '';
      if (!step) { body.appendChild(el('div', { class: 'note', text: want + ' is not included in this file (see --steps of --html)' })); return; }
      renderStep(body, step);
    }).catch((e) => { body.textContent = ''; body.appendChild(el('div', { class: 'error-text', text: 'could not load ' + want + ': ' + e.message })); });
  }

  function stepScale(step) {
    let adv = 0, rmin = Infinity, rmax = -Infinity, any = false;
    for (const r of step.rollouts) for (const c of r.llm_calls) {
      for (const a of c.advantages || []) { const x = num(a); if (x !== null && isFinite(x)) { adv = Math.max(adv, Math.abs(x)); any = true; } }
      const x = num(c.reward); if (x !== null && isFinite(x)) { rmin = Math.min(rmin, x); rmax = Math.max(rmax, x); }
    }
    return { adv: adv || 1, hasAdv: any, rmin: rmin, rmax: rmax };
  }
  function renderStep(body, step) {
    for (const w of step.warnings || []) body.appendChild(el('div', { class: 'note warn', text: w }));
    const scale = stepScale(step);
    const advNote = (step.advantages && step.advantages.note) || '';
    if (state.colour === 'advantage' && !scale.hasAdv) body.appendChild(el('div', { class: 'note', id: 'adv-note', text: advNote || 'no advantages for this file; colouring by allocated reward' }));
    else if (advNote) body.appendChild(el('div', { class: 'muted', id: 'adv-note', text: 'advantages: ' + advNote }));
    const toks = step.tokenizers || {};
    if (Object.keys(toks).length) body.appendChild(el('div', { class: 'muted', text: 'tokens decoded with: ' + Object.keys(toks).map((p) => p + ' → ' + toks[p]).join('; ') }));
    renderScale(scale);
    if (state.group >= step.groups.length) { state.group = 0; state.rollout = -1; writeHash(); }
    // groups: one row per task
    body.appendChild(el('h3', { text: 'Groups (the rollouts of one task)' }));
    const rows = step.groups.map((g, gi) => {
      const statuses = g.rollouts.map((i) => step.rollouts[i].status);
      const tr = el('tr', { class: gi === state.group ? 'sel' : '', 'data-group': gi + 1, onclick: () => { state.group = gi; state.rollout = -1; showStep(); } }, [
        el('td', { class: 'num', text: String(gi + 1) }), el('td', { text: short(g.task, 140) }), el('td', { class: 'num', text: String(g.rollouts.length) }),
        numCell(g.mean_reward), el('td', {}, statuses.map((s) => badge(s, s)).concat(
          g.left_out ? [badge('not trained: ' + g.left_out, 'left-out', 'rollout.filter_groups left this group out of the update')] : [])),
      ]);
      return tr;
    });
    const t = table(['#', 'task', 'rollouts', 'mean reward', 'status'], []);
    t.className = 'groups';
    for (const r of rows) t.appendChild(r);
    body.appendChild(t);
    const g = step.groups[state.group];
    if (!g) return;
    body.appendChild(el('h3', { text: 'Task ' + (state.group + 1) + ': ' + g.rollouts.length + ' rollout(s) side by side' }));
    body.appendChild(el('details', {}, [el('summary', { text: 'task' }), el('pre', { text: asText(g.task) })]));
    const shown = state.rollout >= 0 && state.rollout < g.rollouts.length ? [g.rollouts[state.rollout]] : g.rollouts;
    // the cards wrap onto more rows when they do not all fit across (view.css: .compare), so none is cut off
    const grid = el('div', { class: 'compare', id: 'compare' });
    for (const ri of shown) grid.appendChild(renderRollout(step, ri, g, scale));
    body.appendChild(grid);
    document.body.setAttribute('data-step', step.name);
  }
  function renderScale(scale) {
    const box = document.getElementById('scale');
    box.textContent = '';
    const bar = el('span', { class: 'bar' });
    let lo = '', hi = '';
    if (state.colour === 'logprob') { bar.style.background = 'linear-gradient(to right, hsl(0,75%,80%), hsl(60,75%,80%), hsl(120,75%,80%))'; lo = 'log-prob ≤ −10'; hi = '0 (p = 1)'; }
    else if (state.colour === 'advantage' && scale.hasAdv) { bar.style.background = 'linear-gradient(to right, rgba(207,34,46,.7), #fff, rgba(26,127,55,.7))'; lo = '−' + fmt(scale.adv); hi = '+' + fmt(scale.adv); }
    else { bar.style.background = 'linear-gradient(to right, rgba(9,105,218,.05), rgba(9,105,218,.6))'; lo = 'reward ' + fmt(scale.rmin); hi = fmt(scale.rmax); }
    append(box, [el('span', { class: 'scale' }, [lo, bar, hi])]);
  }

  function renderRollout(step, ri, group, scale) {
    const r = step.rollouts[ri];
    const k = group.rollouts.indexOf(ri);
    const focus = state.rollout >= 0
      ? el('button', { class: 'link', text: 'all side by side', onclick: () => { state.rollout = -1; showStep(); } })
      : el('button', { class: 'link', text: 'only this one', onclick: () => { state.rollout = k; showStep(); } });
    const box = el('div', { class: 'rollout', 'data-rollout': r.rollout_id }, [
      el('div', { class: 'head' }, [el('span', { class: 'rid', text: r.rollout_id }), badge(r.status, r.status),
        el('span', { text: 'reward ' + fmt(r.reward) }), el('span', { class: 'muted', text: r.duration_s !== null && r.duration_s !== undefined ? fmt(r.duration_s, 2) + ' s' : '' }), focus]),
    ]);
    if (r.error) box.appendChild(el('div', { class: 'error-text', text: 'error: ' + r.error }));
    box.appendChild(section('graph of node calls', [renderGraph(r, ri)]));
    box.appendChild(section('rewards', [renderRewards(r)]));
    if (r.forks) box.appendChild(section('counterfactual credit: fork tree', [renderForks(r, ri)]));
    const calls = el('div', {});
    r.llm_calls.forEach((c, ci) => calls.appendChild(renderCall(r, ri, c, ci, scale)));
    box.appendChild(section('LLM calls (' + r.llm_calls.length + ')', [calls]));
    if (r.tool_calls.length) box.appendChild(section('tool calls (' + r.tool_calls.length + ')', [renderTools(r, ri)]));
    box.appendChild(el('details', {}, [el('summary', { text: 'final state' }), el('pre', { text: asText(r.final_state) })]));
    return box;
  }

  // --- the graph: supersteps left to right, subgraph nodes inside their node ----------------------
  function renderGraph(r, ri) {
    const nodes = r.nodes || [];
    const byId = {};
    nodes.forEach((n) => { byId[n.id] = n; });
    const children = {};
    for (const n of nodes) {
      const p = n.parent_id && byId[n.parent_id] ? n.parent_id : '';
      (children[p] = children[p] || []).push(n);
    }
    const callsOf = {}, toolsOf = {};
    r.llm_calls.forEach((c, ci) => { (callsOf[c.node_id] = callsOf[c.node_id] || []).push([c, ci]); });
    (r.tool_calls || []).forEach((t, ti) => { (toolsOf[t.node_id] = toolsOf[t.node_id] || []).push([t, ti]); });
    function level(list) {
      const steps = {};
      for (const n of list) { const s = n.step === null || n.step === undefined ? '?' : String(n.step); (steps[s] = steps[s] || []).push(n); }
      const order = Object.keys(steps).sort((a, b) => (a === '?' ? 1e9 : +a) - (b === '?' ? 1e9 : +b));
      const row = el('div', { class: 'level' });
      order.forEach((s, i) => {
        if (i) row.appendChild(el('span', { class: 'arrow', text: '→' }));
        const col = el('div', { class: 'superstep', 'data-step': s }, el('div', { class: 'steplabel', text: 'step ' + s }));
        const inStep = steps[s];
        // Send branches: several first attempts of one node in one superstep; retries: attempt > 1
        const firsts = {};
        for (const n of inStep) if ((n.attempt || 1) === 1) firsts[n.name] = (firsts[n.name] || 0) + 1;
        const seen = {};
        for (const n of inStep) {
          let branch = null;
          if ((n.attempt || 1) === 1 && firsts[n.name] > 1) { seen[n.name] = (seen[n.name] || 0) + 1; branch = seen[n.name] + '/' + firsts[n.name]; }
          col.appendChild(nodeBox(n, branch));
        }
        row.appendChild(col);
      });
      return row;
    }
    function nodeBox(n, branch) {
      const name = String(n.name);
      const shortName = name.includes(':') ? name.slice(name.lastIndexOf(':') + 1) : name;
      const box = el('div', { class: 'node ' + (n.status || ''), 'data-node': name, title: name + ' · ' + (n.status || '') + (n.start_time && n.end_time ? ' · ' + fmt(n.end_time - n.start_time, 2) + ' s' : '') },
        el('div', { class: 'nname', text: shortName }));
      const badges = el('div', {});
      if (branch) badges.appendChild(badge('Send ' + branch, 'send', 'one of the parallel Send branches of this node in this superstep'));
      if ((n.attempt || 1) > 1) badges.appendChild(badge('retry: attempt ' + n.attempt, 'retry'));
      if (n.status && n.status !== 'ok') badges.appendChild(badge(n.status, n.status));
      if (badges.childNodes.length) box.appendChild(badges);
      if (n.error) box.appendChild(el('div', { class: 'error-text', text: short(n.error, 300), title: String(n.error) }));
      for (const [c, ci] of callsOf[n.id] || []) {
        box.appendChild(el('span', { class: 'chip', title: 'LLM call ' + c.id + ': role ' + c.role + ', policy ' + c.policy,
          text: 'LLM ' + (c.role === n.name ? '' : c.role + ' ') + '→ ' + c.policy + ' · ' + fmt(c.reward), onclick: () => jump('call-' + ri + '-' + ci) }));
      }
      for (const [t, ti] of toolsOf[n.id] || []) {
        box.appendChild(el('span', { class: 'chip tool', title: 'tool call ' + t.id, text: 'tool ' + t.name + (t.status === 'error' ? ' (error)' : ''),
          onclick: () => jump('tool-' + ri + '-' + ti) }));
      }
      const kids = children[n.id];
      if (kids && kids.length) box.appendChild(el('div', { class: 'children', title: 'subgraph of ' + name }, level(kids)));
      return box;
    }
    const top = children[''] || [];
    const wrap = el('div', { class: 'graph' }, top.length ? level(top) : el('span', { class: 'muted', text: 'no node calls recorded' }));
    const orphans = r.llm_calls.map((c, ci) => [c, ci]).filter(([c]) => !c.node_id || !byId[c.node_id]);
    if (orphans.length) {
      wrap.appendChild(el('div', { class: 'muted', text: 'LLM calls outside any node:' }));
      for (const [c, ci] of orphans) wrap.appendChild(el('span', { class: 'chip', text: 'LLM ' + c.role + ' → ' + c.policy, onclick: () => jump('call-' + ri + '-' + ci) }));
    }
    return wrap;
  }
  function jump(id) {
    const target = document.getElementById(id);
    if (!target) return;
    if (target.tagName === 'DETAILS') target.open = true;
    target.scrollIntoView({ behavior: 'smooth', block: 'center' });
    target.classList.add('flash');
    setTimeout(() => target.classList.remove('flash'), 1200);
  }

  // --- rewards: three levels and the allocator's sum per call --------------------------------------
  function renderRewards(r) {
    const rw = r.rewards || {};
    const detail = rw.detail || {};
    const box = el('div', {});
    const na = detail.not_applicable || {};
    const pairs = [['trajectory', rw.trajectory === null || rw.trajectory === undefined ? (na.trajectory ? 'not applicable (None)' : '—') : fmt(rw.trajectory, 4)]];
    const roles = Object.keys(rw.roles || {});
    pairs.push(['roles', roles.length ? roles.map((k) => k + ' ' + fmt(rw.roles[k], 4)).join(', ') : '—']);
    if (na.roles && na.roles.length) pairs.push(['roles not applicable', na.roles.join(', ')]);
    if (detail.allocator) pairs.push(['allocator', detail.allocator + ' · weights ' + Object.keys(detail.weights || {}).map((k) => k + ' ' + fmt(detail.weights[k])).join(', ') +
      (detail.options && Object.keys(detail.options).length ? ' · options ' + asText(detail.options) : '')]);
    if (detail.dropped) pairs.push(['dropped', 'this failed rollout was removed from its group (reward.on_failure = drop)']);
    if (detail.failed) pairs.push(['failed', detail.failed.status + (detail.failed.fill !== undefined ? ': every call gets ' + fmt(detail.failed.fill) : '')]);
    box.appendChild(kv(pairs));
    const rows = r.llm_calls.map((c) => {
      const d = c.reward_detail || {};
      const parts = d.parts || {};
      // a counterfactual part that was not used ({skipped: why}) adds nothing: not a term of the sum
      const expl = Object.keys(parts).filter((lvl) => !(parts[lvl] || {}).skipped).map((lvl) => {
        const p = parts[lvl] || {};
        let s = lvl + ' ' + fmt(p.value, 4) + ' × ' + fmt(p.weight) + ' = ' + fmt(p.contribution, 4);
        if (p.score !== undefined) s += ' (score ' + fmt(p.score, 4) + ' − previous ' + fmt(p.previous, 4) + ')';
        if (p.before !== undefined) s += ' (V after ' + fmt(p.after, 4) + ' − V before ' + fmt(p.before, 4) + ')';
        return s;
      });
      const adv = c.advantages && c.advantages.length ? c.advantages.map(num).filter((x) => x !== null) : null;
      let advText = '—';
      if (adv && adv.length) {
        const lo = Math.min(...adv), hi = Math.max(...adv);
        advText = lo === hi ? signed(lo) : signed(lo) + ' … ' + signed(hi);
      }
      return [c.role + ' / ' + c.policy, el('td', { text: expl.length ? expl.join(' + ') : (d.parts ? 'no level applied: 0' : '—') }),
        el('td', { class: 'num sum', text: fmt(c.reward, 4) }), el('td', { class: 'num', text: advText })];
    });
    if (rows.length) box.appendChild(table(['call (role / policy)', 'levels × weights', 'reward', 'advantage'], rows));
    return box;
  }

  // --- counterfactual credit: per credited turn, the continuations forked before and after it -------
  function renderForks(r, ri) {
    const f = r.forks;
    const box = el('div', { class: 'forks' });
    box.appendChild(el('div', { class: 'muted', text: 'K = ' + (f.k === null ? '?' : f.k) + ' continuations from each checkpoint; V = the mean of their returns; ' +
      'credit = V(after) − V(before), the change in expected return the turn made' }));
    const callIndex = {};
    r.llm_calls.forEach((c, ci) => { callIndex[c.id] = ci; });
    function branch(label, p) {
      const rets = el('span', { class: 'returns' });
      for (const x of p.returns) {
        if (x.value === null) rets.appendChild(badge('failed', 'error', 'continuation ' + x.id + ': no return (' + (x.failed || 'failed') + ', left out of V)'));
        else if (x.failed) rets.appendChild(badge(fmt(x.value, 3) + ' failed', 'error', 'continuation ' + x.id + ': ' + x.failed + '; counted as reward.on_failure = ' + fmt(x.value, 3)));
        else rets.appendChild(badge(fmt(x.value, 3), 'ret', 'continuation ' + x.id));
      }
      if (p.cut) rets.appendChild(el('span', { class: 'muted', text: ' +' + p.cut + ' more' }));
      return el('li', { class: 'branch' }, [el('span', { class: 'blabel', text: label + ' (checkpoint of step ' + p.step + ')',
        title: p.checkpoint_id ? 'checkpoint ' + p.checkpoint_id : '' }), el('span', { class: 'v', text: 'V = ' + fmt(p.value, 4) }), rets]);
    }
    for (const seg of f.segments) {
      const turns = el('span', {});
      for (const cid of seg.calls) {
        const ci = callIndex[cid];
        turns.appendChild(el('span', { class: 'chip inline', text: cid, title: 'LLM call ' + cid, onclick: ci === undefined ? null : () => jump('call-' + ri + '-' + ci) }));
      }
      const credit = num(seg.credit);
      box.appendChild(el('div', { class: 'forktree', 'data-role': seg.role }, [
        el('div', { class: 'turn' }, [el('span', { class: 'frole', text: seg.role }), turns,
          el('span', { class: 'credit ' + (credit === null ? '' : credit > 0 ? 'pos' : credit < 0 ? 'neg' : ''), text: 'credit ' + signed(seg.credit) })]),
        el('ul', {}, [branch('before', seg.before), branch('after', seg.after)]),
      ]));
    }
    if (f.cut) box.appendChild(el('div', { class: 'muted', text: f.cut + ' more segments not shown' }));
    const skipped = Object.keys(f.skipped || {});
    if (skipped.length) box.appendChild(kv(skipped.map((c) => ['not forked: ' + c, f.skipped[c]])));
    return box;
  }

  // --- one LLM call ----------------------------------------------------------------------------------
  function renderMessage(m) {
    const role = m && typeof m === 'object' ? String(m.role || m.type || '?') : '?';
    const box = el('div', { class: 'msg ' + role.replace(/[^a-z]/g, '') }, el('div', { class: 'mrole', text: role + (m && m.name ? ' (' + m.name + ')' : '') + (m && m.tool_call_id ? ' · ' + m.tool_call_id : '') }));
    let content = m && typeof m === 'object' ? m.content : m;
    if (Array.isArray(content)) content = content.map((p) => (p && typeof p === 'object' && typeof p.text === 'string' ? p.text : asText(p))).join('\n');
    box.appendChild(el('div', { class: 'text', text: asText(content) }));
    if (m && m.tool_calls && m.tool_calls.length) box.appendChild(el('pre', { text: 'tool calls: ' + asText(m.tool_calls) }));
    return box;
  }
  function tokenColour(mode, lp, adv, reward, scale) {
    if (mode === 'logprob') {
      if (lp === null) return '';
      const t = Math.max(0, Math.min(1, (isFinite(lp) ? lp : -100) / 10 + 1));
      return 'hsl(' + Math.round(120 * t) + ',75%,80%)';
    }
    if (mode === 'advantage' && scale.hasAdv) {
      if (adv === null || !isFinite(adv)) return '';
      const t = Math.max(-1, Math.min(1, adv / scale.adv));
      const a = (0.08 + 0.62 * Math.abs(t)).toFixed(2);
      return t >= 0 ? 'rgba(26,127,55,' + a + ')' : 'rgba(207,34,46,' + a + ')';
    }
    if (reward === null || !isFinite(reward)) return '';
    const span = scale.rmax - scale.rmin;
    const t = span > 0 ? (reward - scale.rmin) / span : 0.5;
    return 'rgba(9,105,218,' + (0.05 + 0.55 * t).toFixed(2) + ')';
  }
  function renderTokens(c, scale) {
    const box = el('div', { class: 'tokens', 'data-call': c.id });
    const ids = c.response_ids || [];
    const reward = num(c.reward);
    for (let i = 0; i < ids.length; i++) {
      const lp = num((c.logprobs || [])[i]);
      const adv = c.advantages ? num(c.advantages[Math.min(i, c.advantages.length - 1)]) : null;
      const piece = c.pieces ? c.pieces[i] : null;
      let text, cls = 'tok';
      if (piece === null || piece === undefined) { text = '#' + ids[i]; cls += ' id'; }
      else if (piece === '') { text = '·'; cls += ' partial'; }
      else if (/^<\|[^|<>]{1,40}\|>$/.test(piece)) { text = piece; cls += ' special'; }
      else text = /^\n+$/.test(piece) ? '⏎' + piece : piece;
      let title = 'token ' + (i + 1) + ' · id ' + ids[i];
      if (piece !== null && piece !== undefined) title += ' · ' + JSON.stringify(piece);
      title += ' · log-prob ' + fmt(lp, 4) + (lp !== null && isFinite(lp) ? ' (p ' + fmt(Math.exp(lp), 4) + ')' : '');
      if (adv !== null) title += ' · advantage ' + signed(adv);
      title += ' · call reward ' + fmt(reward, 4);
      const span = el('span', { class: cls, title: title, text: text });
      const bg = tokenColour(state.colour, lp, adv, reward, scale);
      if (bg) span.style.background = bg;
      box.appendChild(span);
    }
    if (!ids.length) box.appendChild(el('span', { class: 'muted', text: '(no response tokens recorded: ' + (c.output_text ? 'the text below is what the client received' : 'empty') + ')' }));
    return box;
  }
  function renderCall(r, ri, c, ci, scale) {
    const lps = (c.logprobs || []).map(num).filter((x) => x !== null && isFinite(x));
    const meanLp = lps.length ? lps.reduce((a, b) => a + b, 0) / lps.length : null;
    const box = el('details', { class: 'call', id: 'call-' + ri + '-' + ci, 'data-role': c.role, 'data-policy': c.policy, open: true }, [
      el('summary', { class: 'chead' }, [el('b', { text: c.node || '(no node)' }), badge('role ' + c.role), badge('policy ' + c.policy + (c.trainable === false ? ' (frozen)' : '')),
        el('span', { class: 'muted', text: (c.prompt_tokens || 0) + ' prompt + ' + (c.response_ids || []).length + ' response tokens · ' + (c.finish_reason || '?') +
          ' · mean log-prob ' + fmt(meanLp) }),
        el('span', { text: 'reward ' + fmt(c.reward, 4) })]),
    ]);
    const msgList = Array.isArray(c.messages) ? c.messages : [];
    const msgChars = asText(msgList).length;
    const msgs = el('details', { open: msgChars < 1500 }, el('summary', { text: 'messages (' + msgList.length + ')' }));
    for (const m of msgList) msgs.appendChild(renderMessage(m));
    box.appendChild(msgs);
    box.appendChild(el('div', { class: 'mrole muted', text: 'response tokens' }));
    box.appendChild(renderTokens(c, scale));
    if (c.output_text !== null && c.output_text !== undefined) {
      box.appendChild(el('details', {}, [el('summary', { text: 'answer as the client received it' }), el('div', { class: 'text', text: asText(c.output_text) })]));
    }
    if (c.tool_calls && c.tool_calls.length) box.appendChild(el('div', {}, [el('div', { class: 'mrole muted', text: 'tool calls requested' }), el('pre', { text: asText(c.tool_calls) })]));
    return box;
  }
  function renderTools(r, ri) {
    const box = el('div', {});
    (r.tool_calls || []).forEach((t, ti) => {
      box.appendChild(el('details', { class: 'call', id: 'tool-' + ri + '-' + ti, open: true }, [
        el('summary', {}, [el('b', { text: 'tool ' + t.name }), ' ', badge(t.status || 'ok', t.status || 'ok'), el('span', { class: 'muted', text: ' ' + (t.id || '') })]),
        kv([['input', el('pre', { text: asText(t.input) })], ['output', el('pre', { text: asText(t.output) })]].concat(t.error ? [['error', el('span', { class: 'error-text', text: t.error })]] : [])),
      ]));
    });
    return box;
  }

  // --- start -----------------------------------------------------------------------------------------
  const root = document.getElementById('app');
  root.textContent = '';
  renderOverview(root);
  renderCharts(root);
  renderRolloutsSection(root);
  if (INDEX.steps.length) {
    const train = INDEX.steps.filter((s) => s.kind === 'train');
    state.step = DATA.initial_step || (train.length ? train[train.length - 1] : INDEX.steps[INDEX.steps.length - 1]).name;
    readHash();
    showStep();
  }
  document.body.setAttribute('data-ready', '1');
})();
