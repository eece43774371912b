// ebb dashboard: reads the admin API under /ui/api, follows the log's tail over server-sent
// events and keeps the page current without reloads. Plain DOM code, no dependencies.
'use strict';

const $ = (sel) => document.querySelector(sel);

// Scale events drawn as markers; RequestsSeen is drawn as bars.
const SCALE_EVENTS = new Set(['ScaleRequested', 'ScaledUp', 'ScaledDown', 'ScaleFailed']);
const MAX_TIMELINE_ITEMS = 300;
const CALL_STATES = ['queued', 'running', 'success', 'error', 'timeout', 'cancelled'];

const state = {
  seq: 0,
  skew: 0, // server clock minus browser clock, from the overview's at_ms
  route: null, // the workload the timeline shows
  windowMs: 900000,
  timeline: { route: null, events: new Map() }, // by seq
  story: null, // { kind, id }
  stream: null,
  signedIn: false,
};

const now = () => Date.now() + state.skew;

// ---------------------------------------------------------------------------------------------
// Small helpers.

// Builds an element: h('td', { class: 'num' }, 'text', node, ...). `on*` attributes are listeners.
function h(tag, attrs = {}, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null || v === false) continue;
    if (k === 'class') el.className = v;
    else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? '' : v);
  }
  return fill(el, kids);
}

// Appends nodes and text to `el`, skipping null, false and ''.
function fill(el, kids) {
  for (const kid of [kids].flat(Infinity)) {
    if (kid != null && kid !== false && kid !== '') el.append(kid instanceof Node ? kid : String(kid));
  }
  return el;
}

// The same for SVG elements.
function svg(tag, attrs = {}, ...kids) {
  const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs)) if (v != null) el.setAttribute(k, v);
  for (const kid of kids.flat()) if (kid != null) el.append(kid);
  return el;
}

const pad = (n) => String(n).padStart(2, '0');

// Local time as HH:MM:SS, with the date in front when it is not today.
function clock(ms) {
  const d = new Date(ms);
  const t = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  if (d.toDateString() === new Date(now()).toDateString()) return t;
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${t}`;
}

// "12 s ago", "in 3 min".
function relative(ms) {
  const diff = Math.round((now() - ms) / 1000);
  const s = Math.abs(diff);
  const text = s < 60 ? `${s} s` : s < 3600 ? `${Math.floor(s / 60)} min`
    : s < 86400 ? `${Math.floor(s / 3600)} h` : `${Math.floor(s / 86400)} d`;
  if (s < 1) return 'now';
  return diff >= 0 ? `${text} ago` : `in ${text}`;
}

// A time as <time> (local clock, ISO in its title) and, unless told otherwise, "12 s ago" under it.
function when(ms, { rel = true, none = '–' } = {}) {
  if (ms == null || ms === 0) return h('span', { class: 'muted' }, none);
  const iso = new Date(ms).toISOString();
  const t = h('time', { datetime: iso, title: iso }, clock(ms));
  return rel ? [t, h('span', { class: 'rel', 'data-at': ms }, relative(ms))] : t;
}

function duration(ms) {
  if (ms % 3600000 === 0) return `${ms / 3600000} h`;
  if (ms % 60000 === 0) return `${ms / 60000} min`;
  return `${ms / 1000} s`;
}

const badge = (status) => h('span', { class: `badge st-${status}` }, status);

// A debounced loader: schedule() runs `load` after `delay` ms; never two runs at once, and a
// schedule() during a run asks for one more run after it.
function refresher(load, delay) {
  let timer = null;
  let running = false;
  let again = false;
  async function run() {
    timer = null;
    if (running) { again = true; return; }
    running = true;
    try { await load(); } catch { /* shown by guarded() */ } finally {
      running = false;
      if (again) { again = false; schedule(); }
    }
  }
  function schedule() { if (!timer) timer = setTimeout(run, delay); }
  return { schedule, run };
}

// Keeps a table body's rows in step with `items` without rebuilding the rows that stay, so
// focus and selection survive live updates. `cells(item)` gives [{ content, class, th, keep }];
// a `keep` cell is filled once, when its row is made.
function syncRows(tbody, items, keyAttr, keyOf, cells, emptyText) {
  const width = tbody.closest('table').tHead.rows[0].cells.length;
  if (!items.length) {
    tbody.replaceChildren(h('tr', {}, h('td', { class: 'empty', colspan: width }, emptyText)));
    return;
  }
  const old = new Map();
  for (const row of tbody.rows) if (row.dataset[keyAttr] != null) old.set(row.dataset[keyAttr], row);
  const keep = new Set();
  items.forEach((item, i) => {
    const key = keyOf(item);
    const sig = JSON.stringify(item);
    let row = old.get(key);
    if (!row) {
      row = h('tr', { [`data-${keyAttr}`]: key });
      for (const c of cells(item)) {
        row.append(h(c.th ? 'th' : 'td', { class: c.class, scope: c.th ? 'row' : null }, c.content));
      }
    } else if (row.sig !== sig) { // changed: refill all but the kept cells
      cells(item).forEach((c, j) => {
        if (c.keep) return;
        row.cells[j].replaceChildren();
        fill(row.cells[j], c.content);
      });
    }
    row.sig = sig;
    keep.add(row);
    if (tbody.rows[i] !== row) tbody.insertBefore(row, tbody.rows[i] || null);
  });
  for (const row of [...tbody.rows]) if (!keep.has(row)) row.remove();
}

// ---------------------------------------------------------------------------------------------
// Errors, sign-in and the API.

const errors = new Map(); // source -> message
function setError(source, message) {
  if (message) errors.set(source, message); else errors.delete(source);
  const box = $('#errors');
  const text = [...errors.values()];
  // Only touch the alert region when its text changes, so nothing is announced twice.
  if (box.textContent !== text.join('')) box.replaceChildren(...text.map((t) => h('p', {}, t)));
}

class Unauthorized extends Error {}
class ApiError extends Error {
  constructor(message, code, status) { super(message); this.code = code; this.status = status; }
}

// GET (or other) a JSON endpoint; a 401 shows the sign-in form.
async function api(path, options = {}) {
  let res;
  try {
    res = await fetch(path, { credentials: 'same-origin', headers: { Accept: 'application/json' }, ...options });
  } catch (err) {
    throw new ApiError(`Cannot reach ebb (${err.message})`, 'network', 0);
  }
  if (res.status === 401) { showLogin(); throw new Unauthorized('unauthorized'); }
  const body = res.status === 204 ? null : await res.json().catch(() => null);
  if (!res.ok) throw new ApiError(body?.error || `${res.status} ${res.statusText}`, body?.code, res.status);
  return body;
}

// Runs a load and files its error (if any) under `source`; clears it on success.
async function guarded(source, load) {
  try {
    await load();
    setError(source, null);
  } catch (err) {
    if (!(err instanceof Unauthorized)) setError(source, `${source}: ${err.message}`);
    throw err;
  }
}

function showLogin() {
  if (!state.signedIn && !$('#login').hidden) return;
  state.signedIn = false;
  closeStream();
  $('#dashboard').hidden = true;
  $('#nav').hidden = true;
  $('#logout').hidden = true;
  $('#login').hidden = false;
  $('#token').focus();
}

// Ends the session on the server (its cookie cleared), then shows the sign-in again.
async function signOut() {
  try {
    await fetch('/ui/logout', { method: 'POST', credentials: 'same-origin' });
  } finally {
    showLogin();
  }
}

async function signIn(event) {
  event.preventDefault();
  const input = $('#token');
  const button = event.target.querySelector('button');
  button.disabled = true;
  try {
    await api('/ui/login', {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', Accept: 'application/json' },
      body: JSON.stringify({ token: input.value }),
    });
  } catch (err) {
    setError('Sign-in', err instanceof Unauthorized ? 'Sign-in failed: the token was not accepted.' : `Sign-in failed: ${err.message}`);
    input.focus();
    return;
  } finally {
    button.disabled = false;
  }
  setError('Sign-in', null);
  input.value = '';
  start().catch(() => {}); // errors are shown by guarded()
}

// ---------------------------------------------------------------------------------------------
// The overview: workloads, functions, call counts, cleaners.

function setSeq(seq) {
  if (typeof seq === 'number' && seq > state.seq) {
    state.seq = seq;
    $('#seq').textContent = String(seq);
  }
}

async function loadOverview() {
  const o = await api('/ui/api/overview');
  state.skew = o.at_ms - Date.now();
  setSeq(o.seq);
  renderWorkloads(o.workloads);
  renderFunctions(o.functions);
  renderCallCounts(o.calls_by_state);
  renderCleaners(o.cleaners);
  // The timeline follows the first workload until one is chosen; it falls back when one goes.
  const routes = o.workloads.map((w) => w.route);
  if (!routes.includes(state.route)) selectRoute(routes[0] ?? null);
}
const overview = refresher(() => guarded('Overview', loadOverview), 250);

function storyButton(kind, id, label) {
  return h('button', { type: 'button', onclick: () => openStory(kind, id) }, 'Story', h('span', { class: 'vh' }, ` of ${label}`));
}

function renderWorkloads(workloads) {
  syncRows($('#workloads-body'), workloads, 'route', (w) => w.route, (w) => [
    { th: true, content: w.route, keep: true },
    { content: w.domains.map((d) => h('div', { class: 'mono' }, d)) },
    { class: 'num desired', content: String(w.desired) },
    { class: 'num ready', content: String(w.ready) },
    { content: [`${w.min_replicas}–${w.max_replicas}`, h('span', { class: 'small' }, `idle after ${duration(w.idle_after_ms)}`)] },
    { content: when(w.last_used_ms, { none: 'never' }) },
    { class: 'num', content: w.requests_total.toLocaleString('en') },
    {
      class: 'actions', keep: true,
      content: [
        h('button', { type: 'button', class: 'pick', 'aria-pressed': 'false', onclick: () => selectRoute(w.route) },
          'Timeline', h('span', { class: 'vh' }, ` of ${w.route}`)),
        storyButton('route', w.route, w.route),
      ],
    },
  ], 'No workloads.');
  markSelected();
}

function renderFunctions(functions) {
  syncRows($('#functions-body'), functions, 'name', (f) => f.name, (f) => [
    { th: true, content: f.name, keep: true },
    { class: 'num', content: String(f.counter) },
    { class: 'num', content: `${f.instances_running} / ${f.instances_total}` },
    { content: `${f.min_instances}–${f.max_instances}` },
    { class: 'actions', keep: true, content: storyButton('function', f.name, f.name) },
  ], 'No functions.');
}

function renderCallCounts(counts) {
  const states = [...new Set([...CALL_STATES, ...Object.keys(counts)])];
  $('#call-counts').replaceChildren(...states.map((st) =>
    h('li', {}, badge(st), ' ', h('strong', {}, (counts[st] ?? 0).toLocaleString('en')))));
}

function renderCleaners(cleaners) {
  const result = (c) => [
    c.last_result == null ? h('span', { class: 'muted' }, 'not evaluated')
      : h('span', { class: `badge ${c.last_result ? 'st-success' : 'st-cancelled'}` }, c.last_result ? 'met' : 'not met'),
    c.reason && h('span', { class: 'small' }, c.reason),
    c.message && h('span', { class: 'small' }, c.message),
  ];
  syncRows($('#cleaners-body'), cleaners, 'name', (c) => c.name, (c) => [
    { th: true, content: c.name, keep: true },
    { content: when(c.next_at_ms, { none: 'not scheduled' }) },
    { content: result(c) },
    { content: when(c.fired_at_ms, { none: 'not fired' }) },
    { class: 'actions', keep: true, content: storyButton('cleaner', c.name, c.name) },
  ], 'No cleaners.');
}

// ---------------------------------------------------------------------------------------------
// The timeline of the selected workload.

function selectRoute(route) {
  if (route === state.route) return;
  state.route = route;
  markSelected();
  $('#timeline-route').textContent = route ?? '';
  timeline.run();
}

function markSelected() {
  for (const row of $('#workloads-body').rows) {
    const on = row.dataset.route === state.route;
    row.classList.toggle('selected', on);
    row.querySelector('button.pick')?.setAttribute('aria-pressed', String(on));
  }
}

async function loadTimeline() {
  const route = state.route;
  if (!route) { mergeTimeline(null, []); return; }
  const since = Math.floor(now() - state.windowMs);
  const body = await api(`/ui/api/timeline?route=${encodeURIComponent(route)}&since_ms=${since}`);
  if (route === state.route) mergeTimeline(route, body.events);
}
const timeline = refresher(() => guarded('Timeline', loadTimeline), 0);
const timelineCounts = refresher(() => guarded('Timeline', loadTimeline), 1000);

// Adds events (from the API or the stream) to the timeline of `route`, by seq.
function mergeTimeline(route, events) {
  const tl = state.timeline;
  if (tl.route !== route) { tl.route = route; tl.events = new Map(); }
  for (const ev of events) tl.events.set(ev.seq, ev);
  renderTimeline();
}

// An event from the stream, in the timeline's shape. The stream carries no request count: when
// it is missing, the timeline is read again (once a second at most) for it.
function streamToTimeline(msg) {
  const ev = {
    seq: msg.seq, at_ms: msg.at_ms, name: msg.name, text: msg.text,
    kind: msg.name === 'RequestsSeen' ? 'requests' : 'scale',
    count: msg.count ?? null, replicas: msg.replicas ?? null, desired: msg.desired ?? null,
  };
  if (ev.kind === 'requests' && ev.count == null) timelineCounts.schedule();
  return ev;
}

function timelineEvents() {
  const since = now() - state.windowMs;
  return [...state.timeline.events.values()].filter((e) => e.at_ms >= since).sort((a, b) => a.seq - b.seq);
}

function renderTimeline() {
  const events = timelineEvents();
  renderChart(events);
  // The list: append when the items shown are still the start of it, else rebuild.
  const list = $('#timeline-events');
  const shown = events.slice(-MAX_TIMELINE_ITEMS);
  const box = $('#timeline-box');
  const atBottom = box.scrollTop + box.clientHeight >= box.scrollHeight - 4;
  const items = [...list.children];
  if (list.dataset.route !== String(state.timeline.route)
      || items.some((li, i) => Number(li.dataset.seq) !== shown[i]?.seq)) {
    list.replaceChildren();
    list.dataset.route = String(state.timeline.route);
  }
  for (const ev of shown.slice(list.children.length)) {
    list.append(h('li', { 'data-name': ev.name, 'data-seq': ev.seq, class: ev.kind },
      when(ev.at_ms, { rel: false }),
      h('span', {}, h('span', { class: 'text' }, ev.text), h('span', { class: 'name' }, ev.name))));
  }
  $('#timeline-empty').hidden = shown.length > 0;
  if (atBottom) box.scrollTop = box.scrollHeight;
}

// Requests as bars (60 bins over the window) and scale events as dashed markers.
function renderChart(events) {
  const chart = $('#timeline-chart');
  const W = Math.max(320, Math.floor(chart.clientWidth || 640));
  const H = 150; const top = 16; const bottom = 22; const base = H - bottom;
  const end = now(); const start = end - state.windowMs;
  const bins = 60; const binMs = state.windowMs / bins; const binW = W / bins;
  const counts = new Array(bins).fill(0);
  const x = (ms) => Math.min(W - 6, Math.max(6, ((ms - start) / state.windowMs) * W));
  let requests = 0;
  let scales = 0;
  for (const ev of events) {
    if (ev.kind !== 'requests') continue;
    const i = Math.min(bins - 1, Math.max(0, Math.floor((ev.at_ms - start) / binMs)));
    counts[i] += ev.count ?? 0;
    requests += ev.count ?? 0;
  }
  const max = Math.max(1, ...counts);
  const parts = [
    svg('line', { class: 'grid', x1: 0, x2: W, y1: top, y2: top }),
    svg('text', { x: 4, y: top - 4 }, requests ? `${max} requests per ${duration(binMs)} at most` : 'no requests'),
  ];
  counts.forEach((n, i) => {
    if (!n) return;
    const hgt = Math.max(2, (n / max) * (base - top));
    parts.push(svg('rect', { class: 'bar', x: (i * binW + 0.5).toFixed(1), y: (base - hgt).toFixed(1), width: Math.max(1, binW - 1).toFixed(1), height: hgt.toFixed(1) },
      svg('title', {}, `${n} requests from ${clock(start + i * binMs)}`)));
  });
  // Replicas asked for (dashed) and ready (solid), as steps over the window, on a scale of
  // their own (right).
  const steps = (field) => events.filter((e) => e[field] != null).map((e) => [e.at_ms, e[field]]);
  const desired = steps('desired');
  const ready = steps('replicas');
  const most = Math.max(1, ...desired.map((p) => p[1]), ...ready.map((p) => p[1]));
  const y = (n) => base - (n / most) * (base - top);
  const stairs = (pts, cls) => {
    if (!pts.length) return;
    // From the first change in the window (what ran before it is not known here).
    let d = `M${x(pts[0][0]).toFixed(1)},${y(pts[0][1]).toFixed(1)}`;
    for (const [at, n] of pts.slice(1)) d += ` H${x(at).toFixed(1)} V${y(n).toFixed(1)}`;
    d += ` H${x(end).toFixed(1)}`;
    parts.push(svg('path', { class: cls, d }, svg('title', {}, cls === 'desired' ? 'replicas asked for' : 'replicas ready')));
  };
  stairs(desired, 'desired');
  stairs(ready, 'ready');
  if (desired.length || ready.length) {
    parts.push(svg('text', { x: W - 4, y: top - 4, 'text-anchor': 'end' }, `${most} replicas`));
  }
  for (const ev of events) {
    if (!SCALE_EVENTS.has(ev.name)) continue;
    scales += 1;
    const px = x(ev.at_ms).toFixed(1);
    parts.push(svg('g', { class: `m-${ev.name}` },
      svg('title', {}, `${clock(ev.at_ms)} ${ev.text}`),
      svg('line', { class: 'marker', x1: px, x2: px, y1: top, y2: base }),
      svg('circle', { cx: px, cy: top, r: 4 })));
  }
  parts.push(
    svg('line', { class: 'axis', x1: 0, x2: W, y1: base, y2: base }),
    svg('text', { x: 2, y: H - 6 }, clock(start)),
    svg('text', { x: W / 2, y: H - 6, 'text-anchor': 'middle' }, clock(start + state.windowMs / 2)),
    svg('text', { x: W - 2, y: H - 6, 'text-anchor': 'end' }, 'now'));
  const label = state.timeline.route
    ? `${state.timeline.route}: ${requests} requests and ${scales} scale events in the last ${duration(state.windowMs)}`
    : 'No workload selected';
  chart.replaceChildren(svg('svg', { viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': label }, parts));
}

// ---------------------------------------------------------------------------------------------
// Calls.

async function loadCalls() {
  const filter = $('#call-state').value;
  const body = await api(`/ui/api/calls?${filter ? `state=${encodeURIComponent(filter)}&` : ''}limit=100`);
  if (filter !== $('#call-state').value) { calls.schedule(); return; } // changed meanwhile
  syncRows($('#calls-body'), body.calls, 'id', (c) => c.id, (c) => [
    {
      th: true, keep: true,
      content: h('button', { type: 'button', class: 'link', onclick: () => openStory('call', c.id) },
        c.id, h('span', { class: 'vh' }, ' (story)')),
    },
    { content: c.target },
    { content: c.kind },
    { class: 'status', content: badge(c.status) },
    { content: when(c.queued_at_ms) },
    { content: when(c.started_at_ms) },
    { content: when(c.finished_at_ms) },
    { content: c.runner ?? h('span', { class: 'muted' }, '–') },
  ], filter ? `No ${filter} calls.` : 'No calls.');
}
const calls = refresher(() => guarded('Calls', loadCalls), 250);

// ---------------------------------------------------------------------------------------------
// The story of one object: what the log says about it, and its current state.

// Each part of the id is encoded but its slashes are kept: the server reads the rest of the path.
const idPath = (id) => id.split('/').map(encodeURIComponent).join('/');

function openStory(kind, id) {
  state.story = { kind, id };
  const title = $('#story-title');
  title.replaceChildren(h('span', { class: 'kind' }, kind), h('code', {}, id));
  $('#story-hint').hidden = true;
  title.focus();
  title.scrollIntoView({ block: 'nearest' });
  story.run();
}

async function loadStory() {
  if (!state.story) return;
  const { kind, id } = state.story;
  let body;
  try {
    body = await api(`/ui/api/explain/${kind}/${idPath(id)}`);
  } catch (err) {
    if (state.story?.id === id && state.story.kind === kind && !(err instanceof Unauthorized)) {
      $('#story-lines').replaceChildren(h('li', { class: 'muted' }, err.message));
      $('#story-current').hidden = true;
    }
    throw err;
  }
  if (state.story?.id !== id || state.story.kind !== kind) return; // another was opened meanwhile
  $('#story-lines').replaceChildren(...body.story.map((line) =>
    h('li', { 'data-name': line.event, 'data-seq': line.seq },
      when(line.at_ms, { rel: false }),
      h('span', {}, h('span', { class: 'text' }, line.text), h('span', { class: 'name' }, line.event)))));
  if (!body.story.length) $('#story-lines').append(h('li', { class: 'muted' }, 'No events.'));
  $('#story-current').hidden = false;
  $('#story-json').textContent = body.current == null ? 'none (it is gone)' : JSON.stringify(body.current, null, 2);
}
const story = refresher(() => guarded('Story', loadStory), 1000);

// ---------------------------------------------------------------------------------------------
// The live stream.

function setLive(mode, text) {
  $('#live').dataset.state = mode;
  $('#live-text').textContent = text;
}

function openStream() {
  if (state.stream) return;
  const es = new EventSource('/ui/api/events');
  state.stream = es;
  setLive('wait', 'connecting');
  es.addEventListener('open', () => {
    setLive('on', 'live');
    // Whatever happened while disconnected: read it all again.
    overview.schedule();
    calls.schedule();
    timeline.schedule();
  });
  es.addEventListener('error', () => {
    if (es.readyState === EventSource.CLOSED) {
      // The browser gave up (e.g. 401): check why through the API and try again later.
      state.stream = null;
      setLive('off', 'disconnected');
      overview.run();
      setTimeout(() => { if (state.signedIn) openStream(); }, 5000);
    } else {
      setLive('wait', 'reconnecting');
    }
  });
  es.addEventListener('log', onLogEvent);
  // This page fell too far behind the log's tail: what it shows may miss events; read it all.
  es.addEventListener('resync', () => {
    overview.schedule();
    calls.schedule();
    timeline.schedule();
  });
}

function closeStream() {
  state.stream?.close();
  state.stream = null;
  setLive('off', 'disconnected');
}

function onLogEvent(message) {
  let msg;
  try { msg = JSON.parse(message.data); } catch { return; }
  setSeq(msg.seq);
  overview.schedule();
  if (msg.kind === 'call') calls.schedule();
  const routes = msg.routes || [];
  if (state.route && routes.includes(state.route) && (msg.name === 'RequestsSeen' || SCALE_EVENTS.has(msg.name))) {
    mergeTimeline(state.route, [streamToTimeline(msg)]);
  }
  const s = state.story;
  // A route's story is read from the whole log: not again for each request count.
  const counts = msg.name === 'RequestsSeen';
  if (s && !counts && ((s.kind === msg.kind && s.id === msg.subject) || (s.kind === 'route' && routes.includes(s.id)))) {
    story.schedule();
  }
}

// ---------------------------------------------------------------------------------------------
// Start-up.

// Shows the dashboard once the overview loads; a 401 shows the sign-in form instead, any other
// failure is shown and retried.
async function start() {
  try {
    // Asked first, so a signed-out page shows the form without a refused request.
    const session = await api('/ui/api/session');
    if (!session?.signed_in) { showLogin(); throw new Unauthorized('unauthorized'); }
    await guarded('Overview', loadOverview);
  } catch (err) {
    if (!(err instanceof Unauthorized)) setTimeout(() => start().catch(() => {}), 5000);
    throw err;
  }
  state.signedIn = true;
  $('#login').hidden = true;
  $('#dashboard').hidden = false;
  $('#nav').hidden = false;
  $('#logout').hidden = false;
  calls.run();
  openStream();
}

// Relative times and the chart's window move with the clock.
function tick() {
  for (const el of document.querySelectorAll('.rel[data-at]')) el.textContent = relative(Number(el.dataset.at));
}

document.addEventListener('DOMContentLoaded', () => {
  $('#login-form').addEventListener('submit', signIn);
  $('#logout').addEventListener('click', signOut);
  $('#call-state').addEventListener('change', () => calls.run());
  $('#window').addEventListener('change', (e) => { state.windowMs = Number(e.target.value); timeline.run(); });
  setInterval(tick, 1000);
  setInterval(() => { if (state.signedIn) renderTimeline(); }, 5000);
  let width = 0;
  new ResizeObserver(() => {
    const w = $('#timeline-chart').clientWidth;
    if (w !== width) { width = w; renderTimeline(); }
  }).observe($('#timeline-chart'));
  start().catch(() => {}); // a 401 shows the sign-in form; other errors are shown in the alert
});
