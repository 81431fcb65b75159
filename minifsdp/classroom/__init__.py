"""The classroom: running a course on the book -- grading, the student edition, the find-the-bug lab.

Every section of chapters 1-6 ends with an exercise (``chapters/README.md``: how a section is a course section;
``exercises/INSTRUCTOR.md``: the instructor's guide).  What grades them, hands them out and plugs them into a run:

    course.py            python -m minifsdp course grade | student-copy | bug: the command
    points.py            what is graded and for how many points (exercises/points.csv), the score; CourseError
    course_run.py        one copy's graded tests in a pytest subprocess whose outcomes are signed
    course_remote.py     the learner's code in a process of its own, plain data back
    course_rules.py      what a learner's file may call: each task's rules
    course_class.py      course grade --submissions: a class's copies, one CSV, a feedback file each
    course_copy.py       course student-copy: the student edition (no answers, a fresh git repository)
    course_cut.py        the student edition's cuts: the library's answering functions out, the learner's in
    course_syllabus.py   the student edition's SYLLABUS.md
    course_bug.py        course bug: the find-the-bug lab, one planted fault per student, and its key
    course_bug_fix.py    what of a lab's fix is graded
    student.py           train --impl student: a training run with the learner's functions inside our FSDP
    student_plugs.py     where those functions plug in, each call compared with ours

The command (``course.py``) imports the parts; the parts share ``points.py`` and never import the command.
"""
