// The dashboard in a real browser: signs in, watches a workload wake from zero without a reload,
// opens a failed call's story and checks the page with axe-core. Run by the Rust integration
// test once ebb is up, as `node tests/browser/dashboard.mjs`; it exits non-zero with the reason on
// stderr when a step fails, and writes a screenshot of each step into EBB_ARTIFACTS.
import http from 'node:http';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';
import { CHROMIUM_ARGS, harness } from './harness.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
const TIMEOUT = 30_000;

const { env, fail } = harness('dashboard test');

const ui = env('EBB_UI');
const token = env('EBB_ADMIN_TOKEN');
const proxy = new URL(env('EBB_PROXY'));
const wakeHost = env('EBB_WAKE_HOST');
const wakeRoute = env('EBB_WAKE_ROUTE');
const failedCall = env('EBB_FAILED_CALL');
const executablePath = env('EBB_CHROMIUM', '/usr/bin/chromium');
const artifacts = env('EBB_ARTIFACTS');
fs.mkdirSync(artifacts, { recursive: true });

// One GET through ebb's proxy with the given Host header; resolves with the status and body.
function proxyGet(host) {
  return new Promise((resolve, reject) => {
    const req = http.request({
      host: proxy.hostname, port: proxy.port || 80, path: '/', method: 'GET',
      headers: { Host: host }, timeout: TIMEOUT,
    }, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (chunk) => { body += chunk; });
      res.on('end', () => resolve({ status: res.statusCode, body }));
    });
    req.on('timeout', () => req.destroy(new Error(`no answer within ${TIMEOUT} ms`)));
    req.on('error', reject);
    req.end();
  });
}

// Polls `predicate(arg)` in the page until it holds; fails naming `what` after TIMEOUT.
async function until(page, what, predicate, arg) {
  try {
    await page.waitForFunction(predicate, arg, { timeout: TIMEOUT, polling: 100 });
  } catch (err) {
    throw new Error(`waited ${TIMEOUT / 1000} s until ${what}: ${err.message.split('\n')[0]}`);
  }
}

// Waits for a locator's first match to be visible; fails naming `what` after TIMEOUT.
async function visible(locator, what) {
  try {
    await locator.first().waitFor({ timeout: TIMEOUT });
  } catch (err) {
    throw new Error(`waited ${TIMEOUT / 1000} s for ${what}: ${err.message.split('\n')[0]}`);
  }
}

// Runs one step; a timeout or error becomes a failure naming the step.
let current = '';
async function step(name, run) {
  current = name;
  const started = Date.now();
  await run();
  console.log(`ok   ${name} (${Date.now() - started} ms)`);
}

const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'ebb-chromium-'));
const problems = []; // console errors and page errors, in order
let failure = null;
let context;
let page;

try {
  context = await chromium.launchPersistentContext(profile, {
    executablePath,
    headless: true,
    viewport: { width: 1400, height: 1000 },
    args: CHROMIUM_ARGS,
  });
  context.setDefaultTimeout(TIMEOUT);
  page = context.pages()[0] ?? await context.newPage();
  page.on('console', (msg) => {
    if (msg.type() !== 'error') return;
    const where = msg.location()?.url ?? '';
    const line = `console error: ${msg.text()}${where ? ` (${where})` : ''}`;
    problems.push(line);
  });
  page.on('pageerror', (err) => problems.push(`page error: ${err.stack || err.message}`));

  const row = page.locator(`#workloads-body tr[data-route="${wakeRoute}"]`);

  await step('sign in and see the workloads', async () => {
    await page.goto(ui);
    await visible(page.getByLabel('Admin token'), 'the sign-in form');
    await page.getByLabel('Admin token').fill(token);
    await page.getByRole('button', { name: 'Sign in' }).click();
    await visible(row, `the workloads row of route ${wakeRoute}`);
    await until(page, `route ${wakeRoute} shows 0 ready replicas`,
      (r) => document.querySelector(`tr[data-route="${r}"] .ready`)?.textContent.trim() === '0', wakeRoute);
    // Follow the workload to be woken in the timeline.
    await row.getByRole('button', { name: `Timeline of ${wakeRoute}` }).click();
    await until(page, `the timeline shows route ${wakeRoute}`,
      (r) => document.querySelector('#timeline-events')?.dataset.route === r, wakeRoute);
    await page.screenshot({ path: path.join(artifacts, '01-overview.png'), fullPage: true });
  });

  await step('wake the workload through the proxy and watch it live', async () => {
    const answer = await proxyGet(wakeHost);
    if (answer.status !== 200) {
      throw new Error(`the proxy answered ${answer.status} for Host ${wakeHost}: ${answer.body.slice(0, 300)}`);
    }
    await until(page, `route ${wakeRoute} shows 1 ready replica`,
      (r) => document.querySelector(`tr[data-route="${r}"] .ready`)?.textContent.trim() === '1', wakeRoute);
    await visible(page.locator('#timeline-events li[data-name="ScaledUp"]'), 'a ScaledUp event in the timeline');
    await page.screenshot({ path: path.join(artifacts, '02-woken.png'), fullPage: true });
  });

  await step('find the failed call and open its story', async () => {
    await page.locator('#call-state').selectOption('error');
    await until(page, `the calls table lists call ${failedCall} and only calls in error`, (id) => {
      const rows = [...document.querySelectorAll('#calls-body tr[data-id]')];
      return rows.some((r) => r.dataset.id === id)
        && rows.every((r) => r.querySelector('.status')?.textContent.trim() === 'error');
    }, failedCall);
    await page.locator(`#calls-body tr[data-id="${failedCall}"] button`).click();
    await visible(page.locator('#story li[data-name="CallFinished"]'), 'a CallFinished line in the story');
    await page.screenshot({ path: path.join(artifacts, '03-call-story.png'), fullPage: true });
  });

  await step('no serious or critical accessibility violations (axe-core)', async () => {
    // Evaluated through the browser's debugging protocol, which the page's Content Security
    // Policy (scripts from ebb only) does not cover; a script tag would be refused by it.
    await page.evaluate(fs.readFileSync(path.join(here, 'node_modules', 'axe-core', 'axe.min.js'), 'utf8'));
    const result = await page.evaluate(() => window.axe.run());
    const bad = result.violations.filter((v) => v.impact === 'serious' || v.impact === 'critical');
    for (const v of result.violations) {
      const line = `axe ${v.impact}: ${v.id}: ${v.help} (${v.nodes.map((n) => n.target.join(' ')).join(', ')})`;
      if (bad.includes(v)) console.error(line); else console.log(line);
    }
    if (bad.length) throw new Error(`${bad.length} serious or critical violations: ${bad.map((v) => v.id).join(', ')}`);
  });
} catch (err) {
  failure = `${current}: ${err.message.replace(/\x1b\[[0-9;]*m/g, '').trim()}`;
  const shot = path.join(artifacts, 'failure.png');
  if (await page?.screenshot({ path: shot, fullPage: true }).then(() => true, () => false)) {
    failure += ` (the page then: ${shot})`;
  }
} finally {
  await context?.close().catch(() => {});
  fs.rmSync(profile, { recursive: true, force: true });
}

for (const line of problems) console.error(line);
if (failure) fail(failure);
if (problems.length) fail(`the page logged ${problems.length} errors`);
console.log(`dashboard: 4 steps passed (sign-in, live wake of ${wakeRoute}, call story, axe); screenshots in ${artifacts}`);
