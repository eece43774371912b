// A waiting page in a real browser: Chromium opens an app that is at zero through ebb's proxy,
// sees the route's waiting page, and, without a reload of its own, ends on the app's answer once
// the app is ready (the page reloads itself). Run by tests/waiting.rs as
// `node tests/browser/waiting.mjs`; exits non-zero with the reason on stderr when a step fails,
// and writes a screenshot of each step into EBB_ARTIFACTS.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { chromium } from 'playwright-core';
import { CHROMIUM_ARGS, harness } from './harness.mjs';

const TIMEOUT = 30_000;

const { env, fail } = harness('waiting page test');

const url = env('EBB_APP_URL');
const route = env('EBB_ROUTE');
const executablePath = env('EBB_CHROMIUM', '/usr/bin/chromium');
const artifacts = env('EBB_ARTIFACTS');
fs.mkdirSync(artifacts, { recursive: true });

const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'ebb-chromium-'));
let context;
let failure = null;
try {
  context = await chromium.launchPersistentContext(profile, {
    executablePath,
    headless: true,
    args: CHROMIUM_ARGS,
  });
  context.setDefaultTimeout(TIMEOUT);
  const page = context.pages()[0] ?? await context.newPage();
  // Every document the browser loads, in order: the page's own reloads included.
  const documents = [];
  page.on('response', (res) => {
    if (res.request().resourceType() === 'document') documents.push(res.status());
  });

  const first = await page.goto(url);
  if (first.status() !== 503) throw new Error(`the first load answered ${first.status()}, not the waiting page's 503`);
  const heading = await page.locator('h1').textContent();
  if (heading.trim() !== `${route} is starting`) throw new Error(`the waiting page says ${JSON.stringify(heading)}`);
  const status = page.getByRole('status');
  if (!(await status.textContent()).includes('reloads by itself')) throw new Error('the page does not say it reloads');
  await page.screenshot({ path: path.join(artifacts, '01-waiting.png'), fullPage: true });
  console.log('ok   the waiting page is shown');

  // No reload from here on: the page's own refresh must bring the app's answer (its pid).
  try {
    await page.waitForFunction(() => /^\d+$/.test(document.body?.innerText.trim() ?? ''), null,
      { timeout: TIMEOUT, polling: 100 });
  } catch (err) {
    throw new Error(`waited ${TIMEOUT / 1000} s for the app's answer: ${err.message.split('\n')[0]}`);
  }
  await page.screenshot({ path: path.join(artifacts, '02-app.png'), fullPage: true });
  if (documents[0] !== 503 || documents[documents.length - 1] !== 200) {
    throw new Error(`documents loaded: ${documents.join(', ')}`);
  }
  console.log(`ok   the app's page came by itself after ${documents.length - 1} reloads (${documents.join(', ')})`);
} catch (err) {
  failure = err;
} finally {
  await context?.close();
  fs.rmSync(profile, { recursive: true, force: true });
}
if (failure) fail(failure.stack || String(failure));
