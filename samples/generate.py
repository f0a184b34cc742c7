"""Re-create the binary sample documents (DOCX, PPTX, XLSX, PDF, EML) under samples/docs.

The text formats are written by hand; these are generated so that their content stays reviewable here.
Run with the project's venv: `.venv/bin/python samples/generate.py`. Dates are fixed so output is stable.
"""

from datetime import datetime
from email.message import EmailMessage
from pathlib import Path

DOCS = Path(__file__).parent / "docs"
WHEN = datetime(2024, 6, 3, 9, 0, 0)


def expense_policy_docx(path: Path) -> None:
    import docx

    doc = docx.Document()
    props = doc.core_properties
    props.title, props.author, props.created, props.modified = "Travel and Expense Policy", "Finance Controlling", WHEN, WHEN
    doc.add_heading("Travel and Expense Policy", level=1)
    doc.add_paragraph("Policy FIN-2023-009 sets out which business expenses Northwind Robotics reimburses and how "
                      "to claim them. It applies to all employees and to contractors whose contract refers to it.")
    doc.add_heading("Travel", level=2)
    doc.add_paragraph("Book flights and hotels through the corporate travel portal. Economy class is the default for "
                      "flights under six hours; premium economy is allowed for longer flights. Hotel rates must stay "
                      "below the city cap published by Finance, for example 180 EUR per night in Munich.")
    doc.add_heading("Meals", level=2)
    doc.add_paragraph("Meals while travelling are reimbursed up to a daily allowance of 60 EUR. Alcohol is not "
                      "reimbursed. Client entertainment needs prior approval from a director.")
    doc.add_heading("Claims", level=2)
    doc.add_paragraph("Submit claims in the finance portal within 30 days, with a receipt for every item above 25 EUR. "
                      "Claims older than 90 days are rejected. Questions go to finance-ops@northwind-robotics.com.")
    table = doc.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text, table.rows[0].cells[1].text = "Expense", "Limit"
    for item, limit in [("Hotel, Munich", "180 EUR per night"), ("Meals", "60 EUR per day"), ("Taxi", "Receipts required")]:
        cells = table.add_row().cells
        cells[0].text, cells[1].text = item, limit
    doc.save(path)


def quarterly_review_pptx(path: Path) -> None:
    import pptx

    deck = pptx.Presentation()
    props = deck.core_properties
    props.title, props.author, props.created, props.modified = "Q3 2024 Sales Review", "Sales Operations", WHEN, WHEN
    slides = [
        ("Q3 2024 Sales Review", "EMEA and North America, prepared for the leadership meeting on 2024-10-08."),
        ("Highlights", "Revenue grew 14% year on year to 18.2 million EUR. The NR-7 palletising arm with AVX-039 "
                       "drives was the best-selling configuration, with 212 units shipped."),
        ("Risks", "Lead times for encoder cables (SKU-88412-B) rose to nine weeks. Two large tenders in Poland slipped "
                  "into Q4."),
        ("Next steps", "Qualify a second encoder cable supplier by November and open a Nordic sales office in Q1 2025."),
    ]
    for title, body in slides:
        slide = deck.slides.add_slide(deck.slide_layouts[1])
        slide.shapes.title.text = title
        slide.placeholders[1].text = body
    deck.save(path)


def price_list_xlsx(path: Path) -> None:
    import openpyxl

    book = openpyxl.Workbook()
    book.properties.title, book.properties.creator = "Spare Parts Price List 2024", "Service Parts Team"
    book.properties.created = book.properties.modified = WHEN
    sheet = book.active
    sheet.title = "Spare parts"
    rows = [("SKU", "Description", "Fits", "Price EUR"),
            ("SKU-88412-B", "Encoder cable, 5 m", "NR-7 arm", 149),
            ("SKU-77310-A", "AVX-039 servo drive", "NR-7 arm", 2390),
            ("SKU-77311-A", "AVX-041 servo drive", "NR-9 arm", 2870),
            ("SKU-50102-C", "Cooling fan for AVX drives", "AVX-039, AVX-041", 85)]
    for row in rows:
        sheet.append(row)
    book.save(path)


def _pdf_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def pdf_bytes(pages: list[list[tuple[str, int, str]]], info: bytes) -> bytes:
    """A valid PDF from pages of (font F1 regular or F2 bold, size, line of text), top to bottom; `info` is the
    document information dictionary. Latin-1 text only; no PDF library needed."""
    objects: list[bytes] = []
    page_ids = [5 + 2 * i for i in range(len(pages))]
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{' '.join(f'{p} 0 R' for p in page_ids)}] /Count {len(pages)} >>".encode())
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica-Bold /Encoding /WinAnsiEncoding >>")
    for lines in pages:
        y, ops = 760, []
        for font, size, text in lines:
            y -= size + 12
            ops.append(f"BT /{font} {size} Tf 72 {y} Td ({_pdf_text(text)}) Tj ET")
        stream = "\n".join(ops).encode("latin-1", errors="replace")
        page_id = 5 + 2 * (len(objects) - 4) // 2
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {page_id + 1} 0 R"
                       " /Resources << /Font << /F1 3 0 R /F2 4 0 R >> >> >>".encode())
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    objects.append(info)
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % off for off in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R /Info %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, len(objects), xref)
    return bytes(out)


def access_standard_pdf(path: Path) -> None:
    """A small, valid PDF written by hand (Helvetica, two pages): no PDF library is needed to make it."""
    pages = [
        [("F2", 18, "Access Control Standard"),
         ("F1", 11, "Standard SEC-2024-015, owned by the Information Security Office."),
         ("F2", 14, "Account provisioning"),
         ("F1", 11, "Accounts are created only from an approved access request in the service desk."),
         ("F1", 11, "Each request names the system, the role and the business reason."),
         ("F1", 11, "Managers review the access of their team members every quarter."),
         ("F2", 14, "Passwords and multi-factor authentication"),
         ("F1", 11, "Passwords have at least 14 characters. Multi-factor authentication is mandatory"),
         ("F1", 11, "for remote access, for administrator accounts and for the finance portal.")],
        [("F2", 14, "Privileged access"),
         ("F1", 11, "Administrator rights are granted for at most 30 days and renewed on request."),
         ("F1", 11, "All privileged sessions are recorded by the bastion host and kept for one year."),
         ("F2", 14, "Leavers"),
         ("F1", 11, "Accounts of leavers are disabled on their last working day by 18:00."),
         ("F1", 11, "Report exceptions to security@northwind-robotics.com.")],
    ]
    info = b"<< /Title (Access Control Standard) /Author (Information Security Office) /CreationDate (D:20240415100000Z) >>"
    path.write_bytes(pdf_bytes(pages, info))


def incident_email(path: Path) -> None:
    message = EmailMessage()
    message["From"] = "Service Desk <servicedesk@northwind-robotics.com>"
    message["To"] = "plant-managers@northwind-robotics.com"
    message["Subject"] = "Incident INC0012345 resolved: conveyor line 3 stopped"
    message["Date"] = "Tue, 14 May 2024 16:20:00 +0200"
    message.set_content(
        "Incident INC0012345 is resolved.\n\n"
        "Conveyor line 3 in the Lyon plant stopped at 09:12 after the AVX-039 drive of the NR-7 arm reported fault "
        "F-204 (encoder signal lost). The encoder cable SKU-88412-B was damaged by a cable carrier. Maintenance "
        "replaced the cable and the line restarted at 11:05.\n\n"
        "Follow-up: inspect the cable carriers on lines 1 to 4 this week. Contact servicedesk@northwind-robotics.com "
        "with questions.\n")
    path.write_bytes(bytes(message))


if __name__ == "__main__":
    expense_policy_docx(DOCS / "finance" / "expense-policy.docx")
    quarterly_review_pptx(DOCS / "sales" / "q3-2024-review.pptx")
    price_list_xlsx(DOCS / "products" / "spare-parts-prices.xlsx")
    access_standard_pdf(DOCS / "security" / "access-control-standard.pdf")
    incident_email(DOCS / "support" / "incident-INC0012345.eml")
