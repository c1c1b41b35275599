/* The course's fixes to its theme, loaded on every page of the site.
 *
 * The header's ☰ ("Toggle primary sidebar") and "Contents" buttons. pydata-sphinx-theme
 * 0.17 renders its own pair of toggles in its navbar, which sphinx-book-theme hides,
 * before sphinx-book-theme's visible pair in the article header; both themes attach their
 * handlers to `document.querySelector(".primary-toggle")` (and ".secondary-toggle"), so
 * to the hidden pair: on a phone the sidebars never open, and on a wide screen ☰ never
 * collapses the sidebar (pydata/pydata-sphinx-theme#2451, still so in 0.24). A click on a
 * visible toggle is handed to the button the handlers are on, which then does what each
 * theme means it to: open the sidebar's dialog below 992 px, collapse the sidebar above.
 *
 * The header's buttons carry Bootstrap tooltips that show on hover and on focus. A clicked
 * button kept the focus, so its tooltip stayed over the buttons beside it (the search
 * button, on a phone); sphinx-book-theme's own fix (blur on click) is bound to the hidden
 * pair too. Every header button lets the focus go when clicked, and on a touch screen,
 * where a tap counts as a hover that never ends, the header shows no tooltips.
 */
document.addEventListener("DOMContentLoaded", () => {
  for (const selector of [".primary-toggle", ".secondary-toggle"]) {
    const [bound, ...visible] = document.querySelectorAll(selector);
    for (const button of visible) {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopPropagation();
        button.blur();
        bound.click();
      });
    }
  }
  const touch = window.matchMedia("(hover: none)").matches;
  for (const button of document.querySelectorAll(".bd-header-article button")) {
    const tooltip = window.bootstrap?.Tooltip.getInstance(button);
    if (touch) tooltip?.disable();
    button.addEventListener("click", () => {
      button.blur();
      tooltip?.hide();
    });
  }
});
