"""Drives the review page (`canarygate audit ui`) in headless Chromium with
selenium; prints one JSON object of what it saw, for tests/e2e/review_page.rs
to assert on.

usage: review_page.py BASE_URL ADMIN_TOKEN NOTE

Environment: CANARYGATE_CHROMIUM (default /usr/bin/chromium) and
CANARYGATE_CHROMEDRIVER (default /usr/bin/chromedriver);
CANARYGATE_REVIEW_SCREENSHOTS, when set, names a directory that receives a
PNG of each page visited (for looking at the page, not asserted on).
"""

import json
import os
import shutil
import sys
import tempfile

from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

base_url, token, note = sys.argv[1:4]

options = webdriver.ChromeOptions()
options.binary_location = os.environ.get("CANARYGATE_CHROMIUM", "/usr/bin/chromium")
profile = tempfile.mkdtemp(prefix="canarygate-review-chromium-")
for argument in (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-extensions",
    "--disable-background-networking",
    f"--user-data-dir={profile}",
):
    options.add_argument(argument)
# Console errors (a CSP violation, a script error) are read back below.
options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
service = Service(os.environ.get("CANARYGATE_CHROMEDRIVER", "/usr/bin/chromedriver"))
driver = webdriver.Chrome(options=options, service=service)
driver.set_page_load_timeout(20)
driver.implicitly_wait(0)

result = {"titles": [], "script_elements": 0, "alerts": 0}
screenshots = os.environ.get("CANARYGATE_REVIEW_SCREENSHOTS")


def navigate_by(element):
    """Clicks `element` (a link or a form's button) and waits until the page
    it leads to has loaded: a click returns before its navigation ends on a
    loaded machine, and what is read next would be the page before. A new
    document has a new `performance.timeOrigin`; while the old one goes away,
    the driver may fail to reach either, which counts as not yet."""
    before = driver.execute_script("return performance.timeOrigin")
    element.click()

    def loaded(driver):
        try:
            return driver.execute_script(
                "return document.readyState === 'complete' && performance.timeOrigin"
            ) not in (False, before)
        except WebDriverException:
            return False

    WebDriverWait(driver, 20, poll_frequency=0.02).until(loaded)


def text(selector):
    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return found[0].text if found else None


def visit_check():
    """After every page: what a script would have changed, and any alert."""
    try:
        driver.switch_to.alert.dismiss()
        result["alerts"] += 1
    except NoAlertPresentException:
        pass
    result["titles"].append(driver.title)
    if screenshots:
        driver.set_window_size(1280, 1600)
        driver.save_screenshot(os.path.join(screenshots, f"{len(result['titles']):02}.png"))
    result["script_elements"] += len(driver.find_elements(By.TAG_NAME, "script"))


def record_ids():
    return [row.get_attribute("data-id") for row in driver.find_elements(By.CSS_SELECTOR, "tr.record")]


def login(with_token):
    field = driver.find_element(By.ID, "token")
    field.clear()
    field.send_keys(with_token)
    navigate_by(driver.find_element(By.ID, "login"))
    visit_check()


try:
    # Not logged in: the login form, no records.
    driver.get(base_url + "/")
    visit_check()
    result["before_login_rows"] = len(record_ids())
    result["before_login_form"] = bool(driver.find_elements(By.ID, "token"))

    # A wrong token is refused.
    login(token + "-wrong")
    result["wrong_token_error"] = text("#login-error")
    result["wrong_token_rows"] = len(record_ids())

    login(token)
    result["all_rows"] = record_ids()
    result["count_text"] = text("#count")

    # Filter to failed verdicts through the form.
    Select(driver.find_element(By.ID, "f-verdict")).select_by_value("fail")
    navigate_by(driver.find_element(By.ID, "apply"))
    visit_check()
    result["failed_url"] = driver.current_url
    result["failed_rows"] = record_ids()
    result["failed_verdicts"] = [
        cell.text for cell in driver.find_elements(By.CSS_SELECTOR, "tr.record td:nth-child(3)")
    ]

    # Open the first failed record.
    first = driver.find_elements(By.CSS_SELECTOR, "tr.record td:first-child a")[0]
    result["opened"] = first.text
    navigate_by(first)
    visit_check()
    result["record_heading"] = text("h1")
    result["exposed"] = text("#exposed")
    result["checks"] = text("#checks")
    result["failed_request_text"] = text("#request-text")
    result["failed_response_text"] = text("#response-text")
    result["failed_provider_text"] = text("#provider-text")

    # Mark it bad with a note.
    driver.find_element(By.ID, "verdict-bad").click()
    driver.find_element(By.ID, "note").send_keys(note)
    navigate_by(driver.find_element(By.ID, "submit-review"))
    visit_check()
    result["after_review_url"] = driver.current_url
    result["review_text"] = text("#review")
    result["form_after_review"] = bool(driver.find_elements(By.ID, "review-form"))

    # Follow the exposed session to the victim's own record.
    exposed_links = driver.find_elements(By.CSS_SELECTOR, "#exposed a")
    result["exposed_links"] = [link.text for link in exposed_links]
    if exposed_links:
        navigate_by(exposed_links[0])
        visit_check()
        result["victim_rows"] = record_ids()
        victim = driver.find_elements(By.CSS_SELECTOR, "tr.record td:first-child a")
        if victim:
            navigate_by(victim[-1])
            visit_check()
            result["victim_request_text"] = text("#request-text")
            result["victim_response_text"] = text("#response-text")

    # The charts.
    driver.get(base_url + "/charts")
    visit_check()
    result["chart_svgs"] = len(driver.find_elements(By.TAG_NAME, "svg"))
    result["chart_text"] = driver.find_element(By.TAG_NAME, "main").text

    # What the browser itself logged (a CSP violation would show here).
    result["console"] = [
        entry["message"] for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"
    ]
finally:
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)

print(json.dumps(result))
